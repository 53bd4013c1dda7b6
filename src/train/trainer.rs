//! The training loop. One optimizer step reads top to bottom:
//!
//! ```text
//! batch  = data.sample_batch(data_rng, B)          the same rows however it is split
//! micro  = batch.split(micro_batch)                k micro-batches, weights n_i / N
//! lr     = schedule(step)
//! report = train_step_mixed(model, micro, loss, opt, precision, scaler, clip)
//!            zero grads → for each micro-batch: forward under autocast (blocks
//!            checkpointed), loss · n_i/N (· S), backward → unscale (fp16) →
//!            clip → AdamW step (or skip and back off)
//! ```

use crate::backend::Device;
use crate::memory;
use crate::nn::llama::Llama;
use crate::nn::Module;
use crate::ops::cross_entropy;
use crate::optim::{AdamW, AdamWConfig, Optimizer};
use crate::precision::{autocast, DynamicLossScaler, Precision};
use crate::rng::Generator;
use crate::train::checkpoint::{self, TrainState, Verified};
use crate::train::config::{DeviceChoice, TrainConfig};
use crate::train::data::{Batch, ByteTokenizer, Corpus, Dataset};
use crate::train::metrics::{MetricsLog, StepMetrics};
use crate::train::plan::{memory_plan, mib, MemoryPlan};
use crate::train::plot::{loss_svg, Series};
use crate::train::step::train_step_mixed;
use crate::{bail, Result};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The batch-order stream's key, xored into the seed.
const DATA_KEY: u64 = 0x0ba7_c4e5_0000;

/// Picks the device for `choice`: `auto` takes the GPU when an adapter exists
/// and falls back to the CPU with a one-line note; `gpu` without one is an error.
pub fn select_device(choice: DeviceChoice) -> Result<(Device, Option<String>)> {
    match choice {
        DeviceChoice::Cpu => Ok((Device::Cpu, None)),
        DeviceChoice::Gpu => match crate::backend::gpu::adapter_name() {
            Ok(name) => Ok((Device::Gpu, Some(format!("device: GPU {name}")))),
            Err(e) => bail!(Device, "--device gpu: no GPU adapter is available ({e}); use --device cpu or auto"),
        },
        DeviceChoice::Auto => match crate::backend::gpu::adapter_name() {
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
    crate::backend::gpu::context::ctx().is_ok_and(|c| c.info.device_type == wgpu::DeviceType::Cpu)
}

/// Mean cross-entropy of `batch` under `precision`, without a graph, in chunks
/// of `chunk` rows (weighted by rows). Dropout is off while it runs.
pub fn evaluate(model: &Llama, batch: &Batch, precision: Precision, chunk: usize) -> Result<f32> {
    let _ng = crate::no_grad();
    let _ac = autocast(precision.format());
    model.set_training(false);
    let res = (|| {
        let mut total = 0.0f64;
        for mb in batch.split(chunk) {
            let logits = model.forward(&mb.ids, mb.rows, mb.t, None)?;
            total += cross_entropy(&logits, &mb.targets)?.item()? * mb.rows as f64;
        }
        Ok((total / batch.rows as f64) as f32)
    })();
    model.set_training(true);
    res
}

/// Samples `n` tokens after `prompt`: temperature (0 = greedy), top-k (0 =
/// all), drawing from `gen`. Each step feeds the last `context` tokens.
pub fn generate(
    model: &Llama,
    prompt: &[u32],
    n: usize,
    temperature: f32,
    top_k: usize,
    gen: &Generator,
) -> Result<Vec<u32>> {
    let _ng = crate::no_grad();
    model.set_training(false);
    let mut ids: Vec<u32> = if prompt.is_empty() {
        vec![b'\n' as u32]
    } else {
        prompt.to_vec()
    };
    let v = model.cfg.vocab_size;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let start = ids.len().saturating_sub(model.cfg.context);
        let window = &ids[start..];
        let logits = model.forward(window, 1, window.len(), None)?;
        let last = logits.narrow(0, window.len() - 1, 1)?.to_vec_f32()?;
        let next = sample_logits(&last[..v], temperature, top_k, gen);
        ids.push(next);
        out.push(next);
    }
    model.set_training(true);
    Ok(out)
}

/// One draw from softmax(logits / temperature) restricted to the top k.
pub fn sample_logits(logits: &[f32], temperature: f32, top_k: usize, gen: &Generator) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if temperature <= 0.0 {
        return order[0] as u32;
    }
    let k = if top_k == 0 {
        logits.len()
    } else {
        top_k.min(logits.len())
    };
    let top = &order[..k];
    let m = logits[top[0]] as f64;
    let w: Vec<f64> = top
        .iter()
        .map(|&i| ((logits[i] as f64 - m) / temperature as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let u = gen.uniform(1)[0] as f64 * total;
    let mut acc = 0.0;
    for (j, &wi) in w.iter().enumerate() {
        acc += wi;
        if u < acc {
            return top[j] as u32;
        }
    }
    top[k - 1] as u32
}

/// A run in progress: model, optimizer, scaler, data and their positions.
pub struct Trainer {
    pub cfg: TrainConfig,
    pub device: Device,
    pub model: Llama,
    pub opt: AdamW,
    pub scaler: Option<DynamicLossScaler>,
    pub data: Dataset,
    pub data_rng: Generator,
    pub corpus_name: String,
    pub fingerprint: String,
    /// Optimizer steps taken so far.
    pub step: usize,
    pub plan: MemoryPlan,
}

impl Trainer {
    /// A fresh run on `device` over `corpus`.
    pub fn new(cfg: TrainConfig, device: Device, corpus: &Corpus) -> Result<Trainer> {
        let data = Dataset::new(corpus, cfg.model.context, cfg.seed)?;
        let model = Llama::new(&cfg.model, cfg.seed, device)?;
        let opt = AdamW::new(
            model.parameters(),
            AdamWConfig {
                weight_decay: cfg.weight_decay,
                ..AdamWConfig::new(cfg.lr)
            },
        )?;
        let scaler = (cfg.precision == Precision::Fp16).then(DynamicLossScaler::default);
        let plan = memory_plan(
            &cfg.model,
            cfg.micro_batch,
            cfg.model.context,
            cfg.precision,
            cfg.ckpt_budget,
        )?;
        Ok(Trainer {
            data_rng: Generator::new(cfg.seed ^ DATA_KEY),
            cfg,
            device,
            model,
            opt,
            scaler,
            data,
            corpus_name: corpus.name.clone(),
            fingerprint: corpus.fingerprint.clone(),
            step: 0,
            plan,
        })
    }

    /// Continues the run saved in `dir` with `cfg` (the saved config with the
    /// overrides a resume allows). The corpus must be the one it was trained on.
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
                "--resume {}: the checkpoint was trained on {} (SHA-256 {}), not on {} ({})",
                dir.display(),
                st.data_name,
                st.data_fingerprint,
                corpus.name,
                corpus.fingerprint
            );
        }
        let mut t = Trainer::new(cfg, device, corpus)?;
        let st = checkpoint::restore(&ck, &t.model, &mut t.opt)?;
        match (&mut t.scaler, &st.scaler) {
            (Some(s), Some(saved)) => s.load_state_dict(saved).map_err(|e| {
                e.context(format!("{}/{}", ck.dir.display(), checkpoint::STATE_FILE))
            })?,
            (None, None) => {}
            _ => bail!(
                Config,
                "--resume: the checkpoint's precision ({}) differs from this run's",
                st.config.precision.name()
            ),
        }
        t.model.rng.set_state(st.model_rng);
        t.data_rng.set_state(st.data_rng);
        t.step = st.step;
        Ok(t)
    }

    /// The state a checkpoint records.
    pub fn state(&self) -> TrainState {
        TrainState {
            format: checkpoint::FORMAT.into(),
            step: self.step,
            config: self.cfg.clone(),
            scaler: self.scaler.as_ref().map(|s| s.state_dict()),
            model_rng: self.model.rng.state(),
            data_rng: self.data_rng.state(),
            adam_steps: (0..self.model.parameters().len())
                .map(|i| self.opt.state(i).map(|s| s.2))
                .collect(),
            data_name: self.corpus_name.clone(),
            data_fingerprint: self.fingerprint.clone(),
        }
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
        let (model, ckpt) = (&self.model, self.cfg.ckpt_budget);
        let mut first = true;
        let report = train_step_mixed(
            model,
            &micro,
            |mb: &Batch| {
                let loss =
                    cross_entropy(&model.forward(&mb.ids, mb.rows, mb.t, ckpt)?, &mb.targets)?;
                if std::mem::take(&mut first) {
                    return inject_fault(model, loss, step);
                }
                Ok(loss)
            },
            &mut self.opt,
            self.cfg.precision,
            self.scaler.as_mut(),
            self.cfg.clip,
        )
        .map_err(|e| e.context(format!("step {step}")))?;
        self.step = step;
        let secs = t0.elapsed().as_secs_f64().max(1e-9);
        Ok(StepMetrics {
            step,
            loss: report.loss,
            val_loss: None,
            lr,
            scale: report.scale,
            skipped: report.skipped,
            grad_norm: report.grad_norm,
            tokens_per_s: self.cfg.tokens_per_step() as f64 / secs,
            peak_bytes: memory::peak_bytes(),
        })
    }

    /// Validation loss on the held-out windows.
    pub fn evaluate(&self) -> Result<f32> {
        let b = self.data.val_batch(self.cfg.eval_rows);
        evaluate(
            &self.model,
            &b,
            self.cfg.precision,
            self.cfg.micro_batch.max(8),
        )
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

/// The numerical faults of [`fault`](crate::train::fault) armed for `step`
/// (test-only; a no-op unless `TINYLLM_FAULT` asks for one).
fn inject_fault(model: &Llama, loss: crate::Tensor, step: usize) -> Result<crate::Tensor> {
    use crate::train::fault::armed;
    if armed("loss-inf", step) {
        return loss.mul_scalar(f64::INFINITY);
    }
    if armed("loss-nan", step) {
        return loss.mul_scalar(f64::NAN);
    }
    if armed("grad-inf", step) {
        // + Σ √(p − p): adds exactly 0 to the loss, but d√x/dx = 1/(2√x) = inf at 0.
        let p = &model.parameters()[0];
        let zero = p.sub(&p.detach())?.sqrt()?.sum(-1, false)?.sum(-1, false)?;
        return loss.add(&zero);
    }
    Ok(loss)
}

/// How a run reports progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// indicatif's bar when stderr is a terminal, plain lines otherwise.
    Auto,
    /// Plain log lines.
    Lines,
    /// Only errors.
    Quiet,
}

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct RunSummary {
    pub out: PathBuf,
    pub checkpoint: PathBuf,
    pub history: Vec<StepMetrics>,
    /// Mean training loss of the last few steps (min(10, steps/5) but at least 1).
    pub final_loss: f32,
    pub final_val_loss: Option<f32>,
    pub plan: MemoryPlan,
    /// The highest measured peak of any step.
    pub peak_bytes: usize,
    pub seconds: f64,
    pub device: Device,
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
        name: "train loss",
        color: "#1f77b4",
        points: history
            .iter()
            .map(|m| (m.step as f64, m.loss as f64))
            .collect(),
        dots: false,
    };
    let val = Series {
        name: "validation loss",
        color: "#d62728",
        points: history
            .iter()
            .filter_map(|m| m.val_loss.map(|v| (m.step as f64, v as f64)))
            .collect(),
        dots: true,
    };
    checkpoint::write_atomic(out, "loss.svg", loss_svg(title, &[train, val]).as_bytes())
}

fn say(progress: Progress, msg: &str) {
    if progress != Progress::Quiet {
        eprintln!("{msg}");
    }
}

/// Runs (or, with `resume`, continues) a training run to `cfg.steps`, writing
/// metrics, plot and checkpoints under `cfg.out`.
pub fn run(cfg: TrainConfig, resume: Option<&Path>, progress: Progress) -> Result<RunSummary> {
    let t_start = Instant::now();
    // A profile the caller started (`tinyllm train --profile`) sees the
    // training steps only: everything else here is paused.
    let _not_profiled = crate::profile::pause();
    let (device, note) = select_device(cfg.device)?;
    if let Some(n) = note {
        say(progress, &n);
    }
    let corpus = Corpus::load(cfg.data.as_ref())?;
    let out = cfg.out.clone();
    std::fs::create_dir_all(&out)
        .map_err(|e| crate::Error::io(format!("cannot create {}", out.display()), e))?;
    let mut tr = match resume {
        Some(dir) => Trainer::resume(cfg.clone(), device, &corpus, dir)?,
        None => Trainer::new(cfg.clone(), device, &corpus)?,
    };
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
    say(
        progress,
        &tr.plan.describe(
            cfg.micro_batch,
            cfg.model.context,
            cfg.precision,
            cfg.ckpt_budget,
        ),
    );
    if tr.step > 0 {
        say(
            progress,
            &format!(
                "resumed at step {} from {}",
                tr.step,
                resume.unwrap().display()
            ),
        );
    }
    if tr.step >= cfg.steps {
        bail!(
            Config,
            "the run is already at step {} of {}: give a larger --steps to continue it",
            tr.step,
            cfg.steps
        );
    }
    let mut log = MetricsLog::open(&out, tr.step)?;
    let mut history = if tr.step > 0 {
        MetricsLog::read(log.path()).unwrap_or_default()
    } else {
        vec![]
    };
    let mut last_saved: Option<(PathBuf, usize)> =
        resume.map(|d| (checkpoint::resolve_dir(d), tr.step));

    let bar = (progress == Progress::Auto && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(cfg.steps as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30.cyan/blue} {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_position(tr.step as u64);
        b
    });
    let log_every = (cfg.steps / 20).max(1);
    let mut peak = 0usize;
    while tr.step < cfg.steps {
        let step = {
            let _profiled = crate::profile::unpause();
            tr.train_step()
        };
        let mut m = match step {
            Ok(m) => m,
            Err(e) => {
                if let Some(b) = &bar {
                    b.abandon();
                }
                let where_ = match last_saved {
                    Some((dir, s)) => format!(
                        "the last good checkpoint, {} (step {s}), is intact",
                        dir.display()
                    ),
                    None => "no checkpoint had been written yet".into(),
                };
                return Err(e.map_message(|m| format!("training stopped: {m}. {where_}")));
            }
        };
        peak = peak.max(m.peak_bytes);
        let last = tr.step == cfg.steps;
        if last || (cfg.eval_every > 0 && tr.step % cfg.eval_every == 0) {
            m.val_loss = Some(tr.evaluate()?);
        }
        log.append(&m)?;
        history.push(m.clone());
        let msg = format!(
            "loss {:.4}{} lr {:.2e} scale {} {:.0} tok/s",
            m.loss,
            m.val_loss
                .map(|v| format!(" val {v:.4}"))
                .unwrap_or_default(),
            m.lr,
            m.scale,
            m.tokens_per_s
        );
        match &bar {
            Some(b) => {
                b.set_position(tr.step as u64);
                b.set_message(msg);
            }
            None => {
                if progress != Progress::Quiet
                    && (tr.step % log_every == 0 || last || m.val_loss.is_some() || tr.step == 1)
                {
                    eprintln!(
                        "step {:>5}/{} {msg}{}",
                        tr.step,
                        cfg.steps,
                        if m.skipped {
                            " (skipped: overflow)"
                        } else {
                            ""
                        }
                    );
                }
            }
        }
        if m.val_loss.is_some() {
            write_plot(
                &out,
                &format!("tinyllm {} ({})", cfg.preset, cfg.precision.name()),
                &history,
            )?;
        }
        if last || (cfg.save_every > 0 && tr.step % cfg.save_every == 0) {
            match tr.save(&out) {
                Ok(p) => last_saved = Some((p, tr.step)),
                Err(e) => {
                    if let Some(b) = &bar {
                        b.abandon();
                    }
                    let where_ = match &last_saved {
                        Some((dir, s)) => format!(
                            "the last good checkpoint, {} (step {s}), is intact",
                            dir.display()
                        ),
                        None => "no checkpoint had been written yet".into(),
                    };
                    let step = tr.step;
                    return Err(e.map_message(|m| format!("training stopped: the checkpoint of step {step} could not be written: {m}. {where_}")));
                }
            }
        }
    }
    if let Some(b) = &bar {
        b.finish();
    }
    let losses: Vec<f32> = history.iter().map(|m| m.loss).collect();
    let summary = RunSummary {
        checkpoint: out.join("checkpoint"),
        final_loss: tail_mean(&losses),
        final_val_loss: history.last().and_then(|m| m.val_loss),
        plan: tr.plan,
        peak_bytes: peak,
        seconds: t_start.elapsed().as_secs_f64(),
        device,
        history,
        out,
    };
    say(
        progress,
        &format!(
            "memory: planned peak {} · measured peak {} (tinyllm::memory, largest step)",
            mib(summary.plan.total),
            mib(summary.peak_bytes)
        ),
    );
    Ok(summary)
}

/// A sample from a trained model, as text (the prompt included).
pub fn sample_text(
    model: &Llama,
    prompt: &str,
    n: usize,
    temperature: f32,
    top_k: usize,
    seed: u64,
) -> Result<String> {
    let ids = ByteTokenizer::encode(prompt);
    let out = generate(model, &ids, n, temperature, top_k, &Generator::new(seed))?;
    Ok(format!("{prompt}{}", ByteTokenizer::decode(&out)))
}

/// Mean cross-entropy of `model` over a text (every full window of the model's
/// context, non-overlapping; a shorter text is one window).
pub fn eval_text(model: &Llama, corpus: &Corpus, precision: Precision) -> Result<(f32, usize)> {
    let t = model.cfg.context;
    let toks = &corpus.tokens;
    if toks.len() < 2 {
        bail!(
            Data,
            "{}: need at least 2 bytes of text to evaluate",
            corpus.name
        );
    }
    let t = t.min(toks.len() - 1);
    let windows = (toks.len() - 1) / t;
    let mut ids = Vec::with_capacity(windows * t);
    let mut targets = Vec::with_capacity(windows * t);
    for w in 0..windows {
        ids.extend_from_slice(&toks[w * t..w * t + t]);
        targets.extend_from_slice(&toks[w * t + 1..w * t + t + 1]);
    }
    let b = Batch {
        ids,
        targets,
        rows: windows,
        t,
    };
    Ok((evaluate(model, &b, precision, 8)?, windows * t))
}
