//! A run's full training state in one file PyTorch reads: the
//! **continuation file** (`tinyllm export`, read back by
//! `scripts/continue_in_pytorch.py`). The format is documented for users in
//! `docs/continue-in-pytorch.md`; in short, one safetensors file holding
//!
//! * `{name}` — every weight, float32, under its Hugging Face
//!   `LlamaForCausalLM` name (as in `model.safetensors`);
//! * `{name}.exp_avg`, `{name}.exp_avg_sq` — AdamW's moments, float32, the
//!   names `torch.optim.AdamW` keeps them under; present exactly for the
//!   parameters the metadata gives a step count;
//! * `batch.{i}.input_ids`, `batch.{i}.labels` — int64 `(batch, context)`:
//!   the whole batch of the run's next steps (`i = 0` is step `step + 1`),
//!   drawn exactly as the trainer would draw it (however it splits them into
//!   micro-batches, the rows and their mean loss are the same). `labels` are
//!   the next tokens themselves, not shifted again: the loss is
//!   `cross_entropy(logits, labels)` over every position;
//! * `__metadata__`: `format` = `pt` (what `transformers` asks of a weights
//!   file) and `tinyllm_continue` = a JSON [`ContinueMeta`]: the format
//!   version, the run's id and step, the model's `config.json`, AdamW's
//!   hyper-parameters and step counts, the learning-rate schedule (and the
//!   exact rate of each exported step), the clip, the precision and loss
//!   scaler, and the data position before each exported batch and after them.
//!
//! Why one file: safetensors is what PyTorch reads without running code (no
//! pickle), and a single file cannot pair weights of one step with moments
//! or batches of another.
//!
//! Reading ([`read`]) checks the format version, every moment and every
//! shape against the model the metadata describes, before anything is used;
//! [`Continuation::check_run`] refuses a file of another run. [`import`]
//! turns a file (the script's after its steps, or an export) back into a
//! tinyllm run that `tinyllm train --resume` continues.

use crate::backend::Device;
use crate::nn::llama::{Llama, LlamaConfig};
use crate::nn::Module;
use crate::optim::{AdamW, AdamWConfig, Optimizer};
use crate::precision::ScalerState;
use crate::rng::{Generator, RngState};
use crate::train::checkpoint::{self, RawView, TrainState, Verified};
use crate::train::data::{Corpus, Dataset};
use crate::{bail, Error, Result};
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The continuation format this build writes and reads.
pub const FORMAT: &str = "tinyllm-continue-1";
/// The safetensors metadata key holding the [`ContinueMeta`] JSON.
pub const META_KEY: &str = "tinyllm_continue";
/// The most batches one export holds (each is a whole step's batch).
pub const MAX_BATCHES: usize = 10_000;

/// Everything but tensors, as the JSON under [`META_KEY`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContinueMeta {
    /// [`FORMAT`].
    pub format: String,
    /// The tinyllm version that wrote the file.
    pub tinyllm_version: String,
    /// The run's identity ([`TrainState::run_id`]).
    pub run_id: String,
    /// Optimizer steps taken before the state in the file.
    pub step: usize,
    /// The model's Hugging Face `config.json`.
    pub model: serde_json::Value,
    /// The parameters' names, in the order tinyllm's optimizer holds them.
    pub params: Vec<String>,
    /// AdamW's settings and state.
    pub optimizer: OptimMeta,
    /// The learning-rate schedule.
    pub schedule: ScheduleMeta,
    /// The gradient-norm clip (`None`: off). Clipping multiplies every
    /// gradient by `clip / (norm + 1e-6)` when the global L2 norm exceeds
    /// it, as `torch.nn.utils.clip_grad_norm_` does.
    pub clip: Option<f32>,
    /// The run's precision (`fp32`, `bf16` or `fp16`); PyTorch continues in
    /// float32, so only an fp32 run's losses carry over to the last bits.
    pub precision: String,
    /// The fp16 loss scaler's state (`None` for fp32 and bf16).
    pub scaler: Option<ScalerState>,
    /// Where the data stands.
    pub data: DataMeta,
    /// How many `batch.{i}` pairs the file holds.
    pub batches: usize,
}

/// AdamW as `torch.optim.AdamW` reads it: one parameter group, decoupled
/// weight decay on every parameter (norm gains and embeddings included),
/// no amsgrad.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimMeta {
    /// `betas[0]`.
    pub beta1: f32,
    /// `betas[1]`.
    pub beta2: f32,
    /// Added to `√v̂`.
    pub eps: f32,
    /// Decoupled: each step multiplies the weights by `1 − lr · weight_decay`.
    pub weight_decay: f32,
    /// Each parameter's step count; a parameter not listed has no moments
    /// (never updated).
    pub steps: BTreeMap<String, u64>,
}

/// The learning rate of step `s` (1-based): `lr · s / warmup` while
/// `s <= warmup`, then a cosine from `lr` to `lr · min_lr_frac` at
/// `schedule_steps`, held after it (computed in float64, then rounded to
/// float32).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScheduleMeta {
    /// The peak rate.
    pub lr: f32,
    /// Steps of linear warmup.
    pub warmup: usize,
    /// The step the cosine ends at.
    pub schedule_steps: usize,
    /// The floor, as a fraction of `lr`.
    pub min_lr_frac: f32,
    /// The rate of each exported step, `lrs[i]` for `batch.{i}`.
    pub lrs: Vec<f32>,
}

/// The data position.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataMeta {
    /// `embedded` or the training text's path.
    pub name: String,
    /// The text's SHA-256 (hex).
    pub fingerprint: String,
    /// The run's seed (the split and the batch order derive from it).
    pub seed: u64,
    /// Sequences per step.
    pub batch: usize,
    /// Sequences per micro-batch in tinyllm's run.
    pub micro_batch: usize,
    /// Tokens per sequence.
    pub context: usize,
    /// The batch-order stream's state before each batch and after the last
    /// (`batches + 1` entries): `positions[0]` is where the data stands at
    /// [`ContinueMeta::step`], the state a resumed tinyllm run draws from.
    pub positions: Vec<RngState>,
}

fn i64_raw(ids: &[u32], shape: [usize; 2]) -> RawView {
    RawView {
        dtype: Dtype::I64,
        shape: shape.to_vec(),
        bytes: ids
            .iter()
            .flat_map(|&x| i64::from(x).to_le_bytes())
            .collect(),
    }
}

/// The model and optimizer of the checkpoint `ck`, restored on the CPU
/// (every file checked by [`checkpoint::restore`]), and its state.
fn restored(ck: &Verified) -> Result<(Llama, AdamW, TrainState)> {
    let st = ck.train_state()?;
    let model = Llama::new(&st.config.model, 0, Device::Cpu)?;
    let cfg = AdamWConfig {
        weight_decay: st.config.weight_decay,
        ..AdamWConfig::new(st.config.lr)
    };
    let mut opt = AdamW::new(model.parameters(), cfg)?;
    let st = checkpoint::restore(ck, &model, &mut opt)?;
    Ok((model, opt, st))
}

/// The continuation file of the run checkpointed in `dir` (a run directory
/// or its `checkpoint/`), with the next `batches` batches of `corpus` (the
/// text the run trained on, checked by its SHA-256). Returns the file's
/// bytes and its metadata.
pub fn export(dir: &Path, corpus: &Corpus, batches: usize) -> Result<(Vec<u8>, ContinueMeta)> {
    if batches > MAX_BATCHES {
        bail!(
            Config,
            "--batches {batches}: at most {MAX_BATCHES} batches go into one file"
        );
    }
    let ck = Verified::open(dir)?;
    let (model, opt, st) = restored(&ck)?;
    if st.data_fingerprint != corpus.fingerprint {
        bail!(Config,
            "{}: the run was trained on {} (SHA-256 {}), not on {} ({}); give --data the text it was trained on",
            ck.dir.display(),
            st.data_name,
            st.data_fingerprint,
            corpus.name,
            corpus.fingerprint
        );
    }
    let c = &st.config;
    let data = Dataset::new(corpus, c.model.context, c.seed)?;
    let order = Generator::new(0);
    order.set_state(st.data_rng);
    let mut tensors: Vec<(String, RawView)> = Vec::new();
    let mut lrs = Vec::with_capacity(batches);
    let mut positions = vec![order.state()];
    for i in 0..batches {
        // The trainer's draw for step st.step + 1 + i (Trainer::train_step).
        let b = data.sample_batch(&order, c.batch);
        tensors.push((
            format!("batch.{i}.input_ids"),
            i64_raw(&b.ids, [b.rows, b.t]),
        ));
        tensors.push((
            format!("batch.{i}.labels"),
            i64_raw(&b.targets, [b.rows, b.t]),
        ));
        lrs.push(c.lr_at(st.step + 1 + i));
        positions.push(order.state());
    }
    let mut steps = BTreeMap::new();
    let mut params = Vec::new();
    for (i, (name, t)) in model.named_parameters().into_iter().enumerate() {
        tensors.push((name.clone(), checkpoint::view(&t)?));
        if let Some((m, v, k)) = opt.state(i) {
            tensors.push((format!("{name}.exp_avg"), checkpoint::view(m)?));
            tensors.push((format!("{name}.exp_avg_sq"), checkpoint::view(v)?));
            steps.insert(name.clone(), *k);
        }
        params.push(name);
    }
    let o = opt.cfg;
    let meta = ContinueMeta {
        format: FORMAT.into(),
        tinyllm_version: env!("CARGO_PKG_VERSION").into(),
        run_id: st.run_id.clone(),
        step: st.step,
        model: c.model.to_hf_json(),
        params,
        optimizer: OptimMeta {
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: o.weight_decay,
            steps,
        },
        schedule: ScheduleMeta {
            lr: c.lr,
            warmup: c.warmup,
            schedule_steps: c.schedule_steps,
            min_lr_frac: c.min_lr_frac,
            lrs,
        },
        clip: c.clip,
        precision: c.precision.name().into(),
        scaler: st.scaler,
        data: DataMeta {
            name: st.data_name.clone(),
            fingerprint: st.data_fingerprint.clone(),
            seed: c.seed,
            batch: c.batch,
            micro_batch: c.micro_batch,
            context: c.model.context,
            positions,
        },
        batches,
    };
    let json = serde_json::to_string(&meta).map_err(|e| Error::checkpoint(e.to_string()))?;
    let md = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        (META_KEY.to_string(), json),
    ]);
    let bytes = safetensors::serialize(tensors, Some(md))
        .map_err(|e| Error::checkpoint(format!("safetensors: {e}")))?;
    Ok((bytes, meta))
}

/// One parameter's AdamW state: `exp_avg`, `exp_avg_sq` and its step count.
pub type Moments = (Vec<f32>, Vec<f32>, u64);

/// A continuation file, read and checked ([`read`]).
pub struct Continuation {
    /// Its metadata.
    pub meta: ContinueMeta,
    /// The model it describes.
    pub config: LlamaConfig,
    /// Each parameter's weights, in [`ContinueMeta::params`] order.
    pub weights: Vec<Vec<f32>>,
    /// Each parameter's moments, where it has them.
    pub moments: Vec<Option<Moments>>,
}

impl Continuation {
    /// Refuses a file of a run other than `run_id`'s, naming both.
    pub fn check_run(&self, run_id: &str) -> Result<()> {
        if self.meta.run_id != run_id {
            bail!(Checkpoint,
                "the continuation file is of run {:?}, not of run {run_id:?} (a file from another run)",
                self.meta.run_id
            );
        }
        Ok(())
    }
}

/// The float32 values of `name` in `st`, checked against `shape`.
fn f32_tensor(st: &SafeTensors, name: &str, shape: &[usize], what: &str) -> Result<Vec<f32>> {
    let t = st
        .tensor(name)
        .map_err(|_| Error::checkpoint(format!("missing {what} {name:?}")))?;
    if t.dtype() != Dtype::F32 {
        bail!(
            Checkpoint,
            "{what} {name:?} is {:?}, expected F32",
            t.dtype()
        );
    }
    if t.shape() != shape {
        bail!(Checkpoint,
            "{what} {name:?} has shape {:?}, the model the file's config describes expects {shape:?} (shape mismatch)",
            t.shape()
        );
    }
    Ok(t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// Reads and checks a continuation file's bytes: the metadata's format is
/// [`FORMAT`]; the model it describes is one tinyllm builds; every
/// parameter's weights, and both moments of every parameter with a step
/// count, are there, float32, of the parameter's shape; the batches are
/// there, int64 `(batch, context)`, of byte ids. Errors are
/// [`Error::Checkpoint`]s naming the tensor or field.
pub fn read(bytes: &[u8]) -> Result<Continuation> {
    let (_, header) = SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::checkpoint(format!("not a safetensors file ({e})")))?;
    let json = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get(META_KEY))
        .ok_or_else(|| {
            Error::checkpoint(format!(
                "no {META_KEY:?} metadata: not a tinyllm continuation file (`tinyllm export` writes one)"
            ))
        })?;
    let v: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| Error::checkpoint(format!("the {META_KEY} metadata is not JSON ({e})")))?;
    // The version first, so a file of another version is named as such
    // rather than as a field this build does not know.
    match v.get("format").and_then(|f| f.as_str()) {
        Some(FORMAT) => {}
        f => bail!(Checkpoint,
            "continuation format {}, this tinyllm reads {FORMAT:?} (a file from another version; export it again with this build)",
            f.map_or("missing".to_string(), |f| format!("{f:?}"))
        ),
    }
    let meta: ContinueMeta = serde_json::from_value(v)
        .map_err(|e| Error::checkpoint(format!("the {META_KEY} metadata: {e}")))?;
    let config = LlamaConfig::from_hf_json(&meta.model)
        .map_err(|e| e.context("the continuation file's model config"))?;
    crate::train::config::check_model_size(&config)?;
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| Error::checkpoint(format!("not a valid safetensors file ({e})")))?;
    let model = Llama::new(&config, 0, Device::Cpu)?;
    let expected = model.expected_shapes();
    let names: Vec<&String> = expected.iter().map(|(n, _)| n).collect();
    if meta.params.iter().collect::<Vec<_>>() != names {
        bail!(
            Checkpoint,
            "the metadata lists the parameters {:?}, the model its config describes has {:?}",
            meta.params,
            names
        );
    }
    if let Some(odd) = meta
        .optimizer
        .steps
        .keys()
        .find(|n| !meta.params.contains(n))
    {
        bail!(
            Checkpoint,
            "a step count for {odd:?}, which is no parameter of the model"
        );
    }
    let mut weights = Vec::with_capacity(expected.len());
    let mut moments = Vec::with_capacity(expected.len());
    for (name, shape) in &expected {
        weights.push(f32_tensor(&st, name, shape, "weight")?);
        moments.push(match meta.optimizer.steps.get(name) {
            Some(&k) => Some((
                f32_tensor(&st, &format!("{name}.exp_avg"), shape, "AdamW moment")?,
                f32_tensor(&st, &format!("{name}.exp_avg_sq"), shape, "AdamW moment")?,
                k,
            )),
            None => None,
        });
    }
    let (b, t) = (meta.data.batch, meta.data.context);
    if t != config.context {
        bail!(
            Checkpoint,
            "the data's context is {t}, the model's {} (shape mismatch)",
            config.context
        );
    }
    for i in 0..meta.batches {
        for part in ["input_ids", "labels"] {
            let name = format!("batch.{i}.{part}");
            let x = st
                .tensor(&name)
                .map_err(|_| Error::checkpoint(format!("missing batch tensor {name:?}")))?;
            if x.dtype() != Dtype::I64 || x.shape() != [b, t] {
                bail!(
                    Checkpoint,
                    "batch tensor {name:?} is {:?} {:?}, expected I64 [{b}, {t}] (shape mismatch)",
                    x.dtype(),
                    x.shape()
                );
            }
            let vocab = config.vocab_size as i64;
            let bad = x
                .data()
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .find(|id| !(0..vocab).contains(id));
            if let Some(id) = bad {
                bail!(
                    Checkpoint,
                    "batch tensor {name:?} holds the id {id}, outside 0..{}",
                    vocab - 1
                );
            }
        }
    }
    if meta.data.positions.len() != meta.batches + 1 {
        bail!(
            Checkpoint,
            "the data gives {} positions for {} batches (one before each, one after the last)",
            meta.data.positions.len(),
            meta.batches
        );
    }
    if meta.schedule.lrs.len() != meta.batches {
        bail!(
            Checkpoint,
            "the schedule gives {} rates for {} batches",
            meta.schedule.lrs.len(),
            meta.batches
        );
    }
    Ok(Continuation {
        meta,
        config,
        weights,
        moments,
    })
}

/// [`export`] into the file `out`, written atomically (a temporary file
/// beside it, fsynced, renamed). An existing `out` is replaced only when it
/// is a continuation file itself: tinyllm never overwrites a file it did
/// not write.
pub fn export_to(dir: &Path, corpus: &Corpus, batches: usize, out: &Path) -> Result<ContinueMeta> {
    if out.symlink_metadata().is_ok() && read_file(out).is_err() {
        bail!(Config,
            "{} exists and is not a continuation file: tinyllm does not overwrite it; give another --out",
            out.display()
        );
    }
    let (bytes, meta) = export(dir, corpus, batches)?;
    let name = out
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::config(format!("--out {}: not a file name", out.display())))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    crate::train::outdir::write_atomic(parent, name, &bytes)?;
    Ok(meta)
}

/// [`read`] of the file at `path` (a regular file, read up to a bound
/// above the largest model's state); every error names the file.
pub fn read_file(path: &Path) -> Result<Continuation> {
    let max = 3 * crate::train::config::MAX_MODEL_BYTES as u64 + (1 << 30);
    let bytes = crate::train::outdir::read_regular(path, None, max).map_err(|e| {
        Error::io(
            format!("cannot read the continuation file {}", path.display()),
            e,
        )
    })?;
    read(&bytes).map_err(|e| e.context(path.display()))
}

/// The run checkpointed in `dir`, continued as the continuation `c` says
/// (the script's file after its steps, or an export), written as a new run
/// in `out` whose checkpoint `tinyllm train --resume out` continues: the
/// file's weights, AdamW moments and step counts, its step and data
/// position; the run's config (its `out` now `out`), text, loss scaler
/// (as the file gives it), dropout stream and identity. Refused, before
/// anything is written: a file of another run or of another model, and an
/// `out` that exists and is not empty. Returns the checkpoint's path.
pub fn import(c: &Continuation, dir: &Path, out: &Path) -> Result<std::path::PathBuf> {
    let ck = Verified::open(dir)?;
    let st = ck.train_state()?;
    c.check_run(&st.run_id)?;
    if c.config != st.config.model {
        bail!(
            Checkpoint,
            "the continuation file's model ({:?}) is not the run's ({:?})",
            c.config,
            st.config.model
        );
    }
    if c.meta.data.fingerprint != st.data_fingerprint {
        bail!(
            Checkpoint,
            "the continuation file's text (SHA-256 {}) is not the run's ({})",
            c.meta.data.fingerprint,
            st.data_fingerprint
        );
    }
    let occupied = std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_some());
    if occupied || (out.exists() && !out.is_dir()) {
        bail!(
            Config,
            "--out {}: exists and is not an empty directory; import writes a new run",
            out.display()
        );
    }
    let mut config = st.config.clone();
    config.out = out.to_path_buf();
    let model = Llama::new(&c.config, 0, Device::Cpu)?;
    let mut opt = AdamW::new(
        model.parameters(),
        AdamWConfig {
            weight_decay: config.weight_decay,
            ..AdamWConfig::new(config.lr)
        },
    )?;
    for (i, (p, w)) in model.parameters().iter().zip(&c.weights).enumerate() {
        p.set_storage(crate::backend::Storage::from_f32(w.clone(), Device::Cpu)?)?;
        let state = match &c.moments[i] {
            Some((m, v, k)) => Some((
                crate::Tensor::from_vec(m.clone(), p.shape(), Device::Cpu)?,
                crate::Tensor::from_vec(v.clone(), p.shape(), Device::Cpu)?,
                *k,
            )),
            None => None,
        };
        opt.set_state(i, state)?;
    }
    opt.set_lr(config.lr_after(c.meta.step));
    let state = TrainState {
        format: checkpoint::FORMAT.into(),
        step: c.meta.step,
        config,
        scaler: c.meta.scaler.clone(),
        fp8: None,
        model_rng: st.model_rng,
        data_rng: c.meta.data.positions[0],
        adam_steps: (0..c.moments.len())
            .map(|i| opt.state(i).map(|s| s.2))
            .collect(),
        data_name: st.data_name.clone(),
        data_fingerprint: st.data_fingerprint.clone(),
        run_id: st.run_id.clone(),
        builds: st.builds.clone(),
    };
    std::fs::create_dir_all(out)
        .map_err(|e| Error::io(format!("cannot create {}", out.display()), e))?;
    checkpoint::save(out, &model, &opt, &state)
}
