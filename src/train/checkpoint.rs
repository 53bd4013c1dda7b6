//! Checkpoints and model folders.
//!
//! **A model folder** ([`save_model`], [`load_model`]) is a Hugging Face
//! folder: the weights, `config.json`, the files HF tools expect beside them
//! ([`hf`]: `generation_config.json`, a byte-level `tokenizer.json`,
//! `tokenizer_config.json`) and a `manifest.json` of their SHA-256 hashes
//! (format `MODEL_FORMAT`). [`load_model`]
//! also reads a plain Hugging Face folder without a manifest
//! (`config.json` and a float32 `model.safetensors` of a `LlamaForCausalLM`
//! without grouped-query attention, biases, tied embeddings or RoPE scaling,
//! over the 256 byte tokens).
//!
//! **A training checkpoint** ([`save`], [`restore`]): `DIR/checkpoint/` holds
//!
//! * `model.safetensors` — the weights under Hugging Face `LlamaForCausalLM`
//!   names (`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`,
//!   …, `lm_head.weight`), float32;
//! * `config.json` — the matching HF `LlamaConfig`;
//! * `generation_config.json`, `tokenizer.json`, `tokenizer_config.json` —
//!   as in a model folder, so `transformers` loads a checkpoint as it is
//!   (absent from checkpoints written before them, which still load);
//! * `optimizer.safetensors` — AdamW's moments, `{name}.exp_avg` / `{name}.exp_avg_sq`;
//! * `trainer_state.json` — step, run config, loss-scaler state, RNG states
//!   (dropout and data order), per-parameter AdamW step counts, data fingerprint;
//! * `manifest.json` — SHA-256 and size of every other file, written last.
//!
//! **Writing.** Every file is written to a temporary file in the same
//! directory, fsynced and renamed into place. A checkpoint is first assembled in
//! `checkpoint.next/`, then swapped for the previous `checkpoint/` by two
//! renames, so a crash at any point leaves the last good checkpoint loadable:
//! a crash between the two renames leaves no `checkpoint/` but a complete
//! `checkpoint.next/` (and the previous one in `checkpoint.prev/`), which
//! [`resolve_dir`] finds and the next [`save`] first moves back into place
//! ([`recover`]). The directory is fsynced after the renames. Weights or
//! moments that are not finite are never written over a good checkpoint, a
//! failed save removes its staging directory, and a save holds the output
//! directory's lock and never deletes a directory that is not tinyllm's
//! (see `train::outdir`).
//!
//! **Loading.** The manifest is checked first (every listed file present, of
//! the recorded size and hash), then every tensor's name, dtype and shape
//! against the model the config describes. Only when all of that passes is
//! anything copied into a model or optimizer: a bad checkpoint is an error and
//! nothing is half-loaded. Non-finite weights or moments (which a save never
//! writes) are refused too.

use crate::backend::{Device, Storage};
use crate::nn::llama::{Llama, LlamaConfig};
use crate::nn::Module;
use crate::optim::{AdamW, AdamWConfig, Optimizer};
use crate::precision::{DynamicLossScaler, Precision, ScalerState};
use crate::rng::RngState;
use crate::train::config::TrainConfig;
use crate::train::fault;
use crate::train::hf::{self, HF_FILES};
use crate::train::outdir::{self, DirLock, FileEntry, Manifest, MODEL_FORMAT, STAGING_MARKER};
use crate::train::outdir::{present, sync_dir, CHECKPOINT_DIRS, METRICS_FILE};
use crate::train::provenance::Provenance;
use crate::train::sha256::Sha256;
use crate::{bail, Error, Result, Tensor};
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The weights, float32, under Hugging Face names.
pub const MODEL_FILE: &str = "model.safetensors";
/// The model's Hugging Face `LlamaConfig`.
pub const CONFIG_FILE: &str = "config.json";
/// AdamW's moments.
pub const OPTIM_FILE: &str = "optimizer.safetensors";
/// The [`TrainState`], as JSON.
pub const STATE_FILE: &str = "trainer_state.json";
pub use crate::train::outdir::{write_atomic, FORMAT, MANIFEST_FILE};

/// The largest `config.json` read from a folder without a manifest.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Everything but tensors that a resumed run needs to continue bit for bit.
///
/// Build one with [`TrainState::builder`], which fills in what the model and
/// the optimizer hold and checks the rest ([`check`](TrainState::check));
/// [`save`] refuses a state that does not match its model and optimizer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// The checkpoint format, [`FORMAT`].
    pub format: String,
    /// Optimizer steps taken (skipped fp16 steps included).
    pub step: usize,
    /// The run's resolved config.
    pub config: TrainConfig,
    /// The fp16 loss scaler's state (`None` for fp32 and bf16 runs).
    pub scaler: Option<ScalerState>,
    /// The fp8 recipe's amax histories and scales, as f32 bits (`None`
    /// unless the run is `--fp8`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<crate::precision::Fp8State>,
    /// The dropout stream's state.
    pub model_rng: RngState,
    /// The batch-order stream's state: the data position.
    pub data_rng: RngState,
    /// AdamW's step count per parameter (`None`: never updated).
    pub adam_steps: Vec<Option<u64>>,
    /// The training text's name: `embedded` or its path.
    pub data_name: String,
    /// The SHA-256 of the training text (hex); a resumed run must see the
    /// same text.
    pub data_fingerprint: String,
    /// The run's identity (random, drawn when it started; empty in a
    /// checkpoint written before it was recorded). A resume in the run's own
    /// directory keeps it; a checkpoint continued elsewhere starts a new one.
    #[serde(default)]
    pub run_id: String,
    /// The build and device of each process that trained the run, in order
    /// (one entry per start or resume; empty in older checkpoints).
    #[serde(default)]
    pub builds: Vec<crate::train::provenance::Provenance>,
}

/// Whether `s` is a SHA-256 as tinyllm writes one: 64 lowercase hex digits.
fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl TrainState {
    /// A builder of the state of `model` and `opt` in the run `config`: the
    /// format, the dropout stream's state ([`Llama::rng`]) and AdamW's step
    /// counts are taken from them; the step (default 0), the training text
    /// (required: [`data`](TrainStateBuilder::data) or
    /// [`corpus`](TrainStateBuilder::corpus)), the loss scaler (required for
    /// fp16), the batch-order stream and the run's identity are given to the
    /// builder. [`build`](TrainStateBuilder::build) checks the result
    /// ([`check`](TrainState::check)).
    ///
    /// ```
    /// use tinyllm::nn::Module;
    /// use tinyllm::optim::{AdamW, AdamWConfig};
    /// use tinyllm::train::checkpoint::TrainState;
    /// use tinyllm::train::data::Corpus;
    /// use tinyllm::train::{DeviceChoice, TrainConfig, TrainOptions};
    /// use tinyllm::nn::llama::Llama;
    ///
    /// let cfg = TrainConfig::resolve(&TrainOptions {
    ///     preset: Some("tiny".into()),
    ///     device: Some(DeviceChoice::Cpu),
    ///     ..Default::default()
    /// })?;
    /// let model = Llama::new(&cfg.model, cfg.seed, tinyllm::Device::Cpu)?;
    /// let wd = AdamWConfig { weight_decay: cfg.weight_decay, ..AdamWConfig::new(cfg.lr) };
    /// let opt = AdamW::new(model.parameters(), wd)?;
    /// let corpus = Corpus::embedded();
    /// let state = TrainState::builder(cfg.clone(), &model, &opt).corpus(&corpus).build()?;
    /// assert_eq!(state.format, tinyllm::train::checkpoint::FORMAT);
    /// // A learning rate the run's config does not give is refused.
    /// let other = AdamW::new(model.parameters(), AdamWConfig { lr: 0.5, ..wd })?;
    /// let e = TrainState::builder(cfg, &model, &other).corpus(&corpus).build().unwrap_err();
    /// assert!(e.to_string().contains("learning rate"), "{e}");
    /// # Ok::<(), tinyllm::Error>(())
    /// ```
    pub fn builder<'a>(
        config: TrainConfig,
        model: &'a Llama,
        opt: &'a AdamW,
    ) -> TrainStateBuilder<'a> {
        TrainStateBuilder {
            data_rng: config.data_order().state(),
            config,
            model,
            opt,
            step: 0,
            scaler: None,
            data: None,
            run: None,
        }
    }

    /// Checks the state against the model and optimizer it describes: the
    /// format is [`FORMAT`]; the data fingerprint is a SHA-256 (64 lowercase
    /// hex digits); the run config is valid and its model is `model`'s
    /// architecture; `opt` updates exactly `model`'s parameters, holds the
    /// learning rate the config gives after `step` steps
    /// ([`TrainConfig::lr_after`]), the config's weight decay and the
    /// trainer's betas and eps; the AdamW step counts are `opt`'s (none past
    /// `step`); a loss scaler's state is there exactly for an fp16 run. An
    /// invalid value is an [`Error::Config`], a mismatch with the model or
    /// optimizer an [`Error::Checkpoint`]; each names the field.
    pub fn check(&self, model: &Llama, opt: &AdamW) -> Result<()> {
        if self.format != FORMAT {
            bail!(
                Config,
                "training state: format {:?}, expected {FORMAT:?}",
                self.format
            );
        }
        if !is_sha256_hex(&self.data_fingerprint) {
            bail!(Config,
                "training state: the data fingerprint {:?} is not a SHA-256 (64 lowercase hex digits, as Corpus::fingerprint gives it): a resumed run could not recognise its text",
                self.data_fingerprint
            );
        }
        self.config
            .validate()
            .map_err(|e| e.context("training state: the run config"))?;
        let c = &self.config;
        if self.step > crate::train::config::MAX_STEPS {
            bail!(
                Config,
                "training state: step {} is more than any run takes",
                self.step
            );
        }
        let mismatch = |what: String| {
            Err(Error::checkpoint(format!(
                "the training state does not match the model and optimizer: {what}"
            )))
        };
        if c.model != model.cfg {
            return mismatch(format!(
                "the run config's model is {:?}, the model is {:?}",
                c.model, model.cfg
            ));
        }
        let params = model.parameters();
        let same = opt.params().len() == params.len()
            && opt
                .params()
                .iter()
                .zip(&params)
                .all(|(a, b)| a.id() == b.id());
        if !same {
            return mismatch(format!(
                "the optimizer updates {} tensors that are not the model's {} parameters (build it with AdamW::new(model.parameters(), ..))",
                opt.params().len(),
                params.len()
            ));
        }
        let want = c.lr_after(self.step);
        let lr = opt.lr();
        if !((lr - want).abs() <= 1e-6 * want.abs()) {
            return mismatch(format!(
                "the optimizer's learning rate is {lr}, but the run config (lr {}, warmup {}, cosine to step {}) gives {want} after step {}",
                c.lr, c.warmup, c.schedule_steps, self.step
            ));
        }
        let d = AdamWConfig::new(c.lr);
        let o = opt.cfg;
        if o.weight_decay != c.weight_decay {
            return mismatch(format!(
                "the optimizer's weight decay is {}, the run config's {}",
                o.weight_decay, c.weight_decay
            ));
        }
        if (o.beta1, o.beta2, o.eps) != (d.beta1, d.beta2, d.eps) {
            return mismatch(format!(
                "the optimizer's betas ({}, {}) and eps {} are not the ones a resumed run uses ({}, {}) and {}",
                o.beta1, o.beta2, o.eps, d.beta1, d.beta2, d.eps
            ));
        }
        if self.adam_steps.len() != params.len() {
            return mismatch(format!(
                "adam_steps has {} entries for {} parameters",
                self.adam_steps.len(),
                params.len()
            ));
        }
        for (i, k) in self.adam_steps.iter().enumerate() {
            let held = opt.state(i).map(|s| s.2);
            if *k != held {
                return mismatch(format!(
                    "adam_steps[{i}] is {k:?}, the optimizer's {held:?}"
                ));
            }
            if k.is_some_and(|k| k > self.step as u64) {
                return mismatch(format!(
                    "adam_steps[{i}] is {k:?}, more than the {} steps taken",
                    self.step
                ));
            }
        }
        let fp16 = c.precision == Precision::Fp16;
        if fp16 != self.scaler.is_some() {
            return mismatch(if fp16 {
                "an fp16 run needs its loss scaler's state (TrainStateBuilder::scaler)".into()
            } else {
                format!(
                    "a {} run has no loss scaler, but a scaler state was given",
                    c.precision.name()
                )
            });
        }
        Ok(())
    }
}

/// Builds a checked [`TrainState`] ([`TrainState::builder`]).
pub struct TrainStateBuilder<'a> {
    config: TrainConfig,
    model: &'a Llama,
    opt: &'a AdamW,
    step: usize,
    scaler: Option<ScalerState>,
    data_rng: RngState,
    data: Option<(String, String)>,
    run: Option<(String, Vec<Provenance>)>,
}

impl TrainStateBuilder<'_> {
    /// Optimizer steps taken (default 0).
    pub fn step(mut self, step: usize) -> Self {
        self.step = step;
        self
    }

    /// The training text: its name (`embedded` or its path) and SHA-256 (hex).
    pub fn data(mut self, name: impl Into<String>, fingerprint: impl Into<String>) -> Self {
        self.data = Some((name.into(), fingerprint.into()));
        self
    }

    /// The training text, from the corpus itself.
    pub fn corpus(self, corpus: &crate::train::data::Corpus) -> Self {
        self.data(corpus.name.clone(), corpus.fingerprint.clone())
    }

    /// The fp16 loss scaler (required for an fp16 run, refused otherwise).
    pub fn scaler(mut self, scaler: &DynamicLossScaler) -> Self {
        self.scaler = Some(scaler.state_dict());
        self
    }

    /// The batch-order stream's state (default: where the run's stream
    /// starts, [`TrainConfig::data_order`]).
    pub fn data_rng(mut self, state: RngState) -> Self {
        self.data_rng = state;
        self
    }

    /// The run's identity and the builds that trained it (default: a new
    /// run id, and this build on the model's device).
    pub fn run(mut self, run_id: impl Into<String>, builds: Vec<Provenance>) -> Self {
        self.run = Some((run_id.into(), builds));
        self
    }

    /// The state, checked ([`TrainState::check`]); an error also when no
    /// training text was given.
    pub fn build(self) -> Result<TrainState> {
        let Some((data_name, data_fingerprint)) = self.data else {
            bail!(Config,
                "training state: no training text given (TrainStateBuilder::corpus or ::data): a resumed run checks its text by SHA-256"
            );
        };
        let (run_id, builds) = self.run.unwrap_or_else(|| {
            (
                outdir::new_run_id(),
                vec![Provenance::here(self.model.device())],
            )
        });
        let n = self.model.parameters().len();
        let st = TrainState {
            format: FORMAT.into(),
            step: self.step,
            config: self.config,
            scaler: self.scaler,
            fp8: None,
            model_rng: self.model.rng.state(),
            data_rng: self.data_rng,
            adam_steps: (0..n).map(|i| self.opt.state(i).map(|s| s.2)).collect(),
            data_name,
            data_fingerprint,
            run_id,
            builds,
        };
        st.check(self.model, self.opt)?;
        Ok(st)
    }
}

fn io_err(what: &str, p: &Path, e: std::io::Error) -> Error {
    Error::io(format!("{what} {}", p.display()), e)
}

/// [`write_atomic`] without the directory sync (the caller syncs once), with
/// the `write:NAME` fault point of checkpoint `step`.
fn write_atomic_at(dir: &Path, name: &str, bytes: &[u8], step: usize) -> Result<()> {
    outdir::write_atomic_with(dir, name, |f| {
        fault::io_point(&format!("fail:{name}"), step)?;
        if fault::armed(&format!("write:{name}"), step) {
            f.write_all(&bytes[..bytes.len() / 2])?;
            fault::pause_point(&format!("write:{name}"), step);
        }
        f.write_all(bytes)
    })
}

/// A little-endian tensor for `safetensors::serialize` (the continuation
/// file's too).
pub(crate) struct RawView {
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<usize>,
    pub(crate) bytes: Vec<u8>,
}

impl safetensors::View for RawView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        (&self.bytes).into()
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// `t`'s values as a float32 [`RawView`].
pub(crate) fn view(t: &Tensor) -> Result<RawView> {
    let v = t.to_vec_f32()?;
    Ok(RawView {
        dtype: Dtype::F32,
        shape: t.shape().to_vec(),
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    })
}

fn serialize(tensors: Vec<(String, RawView)>, meta: HashMap<String, String>) -> Result<Vec<u8>> {
    safetensors::serialize(tensors, Some(meta))
        .map_err(|e| Error::checkpoint(format!("safetensors: {e}")))
}

/// Where a checkpoint lives: `dir` itself when it holds a manifest or a
/// `config.json` (a checkpoint or model folder given directly) and no
/// checkpoint directory of a run, else `dir/checkpoint`; after a crash
/// between [`save`]'s two renames (no `checkpoint/`, but a
/// `checkpoint.prev/`), the complete `checkpoint.next/` (or, failing that,
/// `checkpoint.prev/`).
pub fn resolve_dir(dir: &Path) -> PathBuf {
    let run = CHECKPOINT_DIRS.iter().any(|n| present(&dir.join(n)));
    if !run && (dir.join(MANIFEST_FILE).exists() || dir.join(CONFIG_FILE).exists()) {
        return dir.to_path_buf();
    }
    let (fin, next, prev) = (
        dir.join("checkpoint"),
        dir.join("checkpoint.next"),
        dir.join("checkpoint.prev"),
    );
    if !present(&fin) {
        // The manifest is the last file staged: with it, the staging is
        // complete (and `Verified::open` checks every byte of it anyway).
        if next.join(MANIFEST_FILE).exists() {
            return next;
        }
        if outdir::is_ours(&prev) {
            return prev;
        }
    }
    fin
}

/// Repairs `run_dir` after a crash inside [`save`]'s swap: when `checkpoint/`
/// is missing, a staged `checkpoint.next/` that verifies (the swap starts only
/// after it is complete and synced) is moved into place, else a
/// `checkpoint.prev/` is moved back. Anything else is left as it is (a partial
/// `checkpoint.next/` beside a good `checkpoint/` is cleared by the next save).
pub fn recover(run_dir: &Path) -> Result<()> {
    let (fin, next, prev) = (
        run_dir.join("checkpoint"),
        run_dir.join("checkpoint.next"),
        run_dir.join("checkpoint.prev"),
    );
    if present(&fin) {
        return Ok(());
    }
    let from = if next.join(MANIFEST_FILE).exists() && Verified::open(&next).is_ok() {
        &next
    } else if outdir::is_ours(&prev) {
        &prev
    } else {
        return Ok(());
    };
    std::fs::rename(from, &fin)
        .map_err(|e| io_err("cannot restore the checkpoint from", from, e))?;
    sync_dir(run_dir);
    Ok(())
}

/// The first tensor with a non-finite value, if any.
fn first_non_finite(tensors: &[(String, RawView)]) -> Option<&str> {
    tensors.iter().find_map(|(n, v)| {
        v.bytes
            .chunks_exact(4)
            .any(|b| !f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite())
            .then_some(n.as_str())
    })
}

/// Writes a complete checkpoint to `run_dir/checkpoint/` (see the module docs)
/// and returns its path. On an error the previous checkpoint is as it was and
/// no staging directory is left behind.
///
/// A `state` that does not [`check`](TrainState::check) against `model` and
/// `opt` is refused before anything is written.
pub fn save(run_dir: &Path, model: &Llama, opt: &AdamW, state: &TrainState) -> Result<PathBuf> {
    state.check(model, opt).map_err(|e| {
        e.map_message(|m| {
            format!(
                "refusing to write a checkpoint into {}: {m}",
                run_dir.display()
            )
        })
    })?;
    let _lock = DirLock::acquire(run_dir)?;
    outdir::check_no_foreign(run_dir)?;
    // A crash inside an earlier swap: put the good checkpoint back before the
    // staging area (which may hold it) is cleared.
    recover(run_dir)?;
    let step = state.step;
    // Everything is encoded (and checked finite) before the staging area is made.
    let files = encode(run_dir, model, opt, state)?;
    let staging = run_dir.join("checkpoint.next");
    outdir::remove_ours(&staging)?;
    std::fs::create_dir(&staging).map_err(|e| io_err("cannot create", &staging, e))?;
    if let Err(e) = stage(&staging, &files, step) {
        let _ = outdir::remove_ours(&staging);
        sync_dir(run_dir);
        return Err(e);
    }
    swap(run_dir, &staging, step)
}

/// The checkpoint's files, in the order they are written; refuses non-finite
/// weights or moments.
fn encode(
    run_dir: &Path,
    model: &Llama,
    opt: &AdamW,
    state: &TrainState,
) -> Result<Vec<(&'static str, Vec<u8>)>> {
    let named = model.named_parameters();
    let weights = weight_views(model)?;
    let mut moments = Vec::new();
    for (i, (n, _)) in named.iter().enumerate() {
        if let Some((m, v, _)) = opt.state(i) {
            moments.push((format!("{n}.exp_avg"), view(m)?));
            moments.push((format!("{n}.exp_avg_sq"), view(v)?));
        }
    }
    for (what, t) in [("weights", &weights), ("optimizer moments", &moments)] {
        if let Some(n) = first_non_finite(t) {
            bail!(Checkpoint,
                "refusing to write a checkpoint at step {}: the {what} of {n:?} are not finite (NaN or inf); the previous checkpoint in {} is kept",
                state.step,
                run_dir.display()
            );
        }
    }
    let mut files = model_files(model, weights)?;
    files.push((OPTIM_FILE, serialize(moments, pt_meta())?));
    files.push((
        STATE_FILE,
        serde_json::to_vec_pretty(state).map_err(|e| Error::checkpoint(e.to_string()))?,
    ));
    Ok(files)
}

/// safetensors metadata `{"format": "pt"}`, which `transformers` asks for.
fn pt_meta() -> HashMap<String, String> {
    HashMap::from([("format".to_string(), "pt".to_string())])
}

/// Every weight of `model` under its Hugging Face name, as float32 bytes.
fn weight_views(model: &Llama) -> Result<Vec<(String, RawView)>> {
    model
        .named_parameters()
        .iter()
        .map(|(n, t)| Ok((n.clone(), view(t)?)))
        .collect()
}

/// A model folder's files but its manifest, in the order they are written:
/// the weights, `config.json`, then [`HF_FILES`].
fn model_files(
    model: &Llama,
    weights: Vec<(String, RawView)>,
) -> Result<Vec<(&'static str, Vec<u8>)>> {
    let config = serde_json::to_vec_pretty(&model.cfg.to_hf_json())
        .map_err(|e| Error::checkpoint(e.to_string()))?;
    let mut files = vec![
        (MODEL_FILE, serialize(weights, pt_meta())?),
        (CONFIG_FILE, config),
    ];
    files.extend(hf::files(&model.cfg));
    Ok(files)
}

/// Writes `model` as a Hugging Face model folder `dir` (created if needed):
/// `model.safetensors` (float32, `LlamaForCausalLM` names), `config.json`,
/// `generation_config.json`, `tokenizer.json` and `tokenizer_config.json`
/// (the byte tokenizer: see [`hf`]), then `manifest.json` with the
/// SHA-256 of each (format `MODEL_FORMAT`). [`load_model`] reads it back,
/// `tinyllm eval`/`generate --checkpoint DIR` and `transformers` load it.
/// Weights only: no optimizer or training state (a run's checkpoint,
/// [`save`], has those).
///
/// Each file is written atomically (a new temporary file, fsynced, renamed
/// into place), the manifest last; while it writes, `dir` holds tinyllm's
/// lock (`.tinyllm.lock`), so two processes never save into it at once.
/// Refused before anything is written, with an [`Error::Config`] naming the
/// path: a `dir` that is or lies inside a run's checkpoint, one that holds a
/// run (checkpoint directories or `metrics.jsonl`), and a file of the
/// folder's names that tinyllm did not write (not listed by the manifest of
/// an earlier save, a link, or not a regular file) — nothing is overwritten
/// that is not tinyllm's and nothing is deleted. Non-finite weights are an
/// [`Error::Checkpoint`].
///
/// ```
/// use tinyllm::nn::llama::{Llama, LlamaConfig};
/// use tinyllm::train::{load_model, save_model};
/// use tinyllm::Device;
///
/// let dir = std::env::temp_dir().join(format!("tinyllm-doc-save-{}", std::process::id()));
/// let model = Llama::new(&LlamaConfig::preset("tiny")?, 7, Device::Cpu)?;
/// save_model(&model, &dir)?;
/// assert!(dir.join("tokenizer.json").exists());
/// let back = load_model(&dir, Device::Cpu)?;
/// let ids: Vec<u32> = b"a tiny test".iter().map(|&b| b as u32).collect();
/// let (a, b) = (model.forward(&ids, 1, ids.len())?, back.forward(&ids, 1, ids.len())?);
/// assert_eq!(a.to_vec_f32()?, b.to_vec_f32()?);
/// save_model(&back, &dir)?; // its own earlier save is replaced
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), tinyllm::Error>(())
/// ```
pub fn save_model(model: &Llama, dir: &Path) -> Result<()> {
    if let Some(ck) = outdir::checkpoint_containing(dir) {
        bail!(Config,
            "save_model: {} is inside the training checkpoint {} (its run's next save would refuse or replace the model's files): save the model elsewhere",
            dir.display(),
            ck.display()
        );
    }
    if let Some(n) = CHECKPOINT_DIRS
        .iter()
        .chain(&[METRICS_FILE])
        .find(|n| present(&dir.join(n)))
    {
        bail!(Config,
            "save_model: {} holds a training run ({n}): a model folder of its own keeps the run's files and the model's apart; give another directory",
            dir.display()
        );
    }
    // Everything encoded (and checked finite) before the directory is touched.
    let weights = weight_views(model)?;
    if let Some(n) = first_non_finite(&weights) {
        bail!(
            Checkpoint,
            "save_model: refusing to write {}: the weights of {n:?} are not finite (NaN or inf)",
            dir.display()
        );
    }
    let files = model_files(model, weights)?;
    let _lock = DirLock::acquire(dir)?;
    check_model_targets(dir, &files)?;
    let mut manifest = Manifest {
        format: MODEL_FORMAT.into(),
        files: BTreeMap::new(),
    };
    for (name, bytes) in &files {
        outdir::write_atomic_with(dir, name, |f| f.write_all(bytes))?;
        manifest.files.insert(
            name.to_string(),
            FileEntry {
                sha256: Sha256::digest_hex(bytes),
                bytes: bytes.len() as u64,
            },
        );
    }
    let mbytes =
        serde_json::to_vec_pretty(&manifest).map_err(|e| Error::checkpoint(e.to_string()))?;
    outdir::write_atomic_with(dir, MANIFEST_FILE, |f| f.write_all(&mbytes))?;
    sync_dir(dir);
    Ok(())
}

/// Refuses to replace any of `files` (or the manifest) in `dir` that
/// tinyllm did not write: each must be absent, or a regular file that the
/// manifest of an earlier save lists (the manifest itself: a tinyllm model
/// manifest).
fn check_model_targets(dir: &Path, files: &[(&str, Vec<u8>)]) -> Result<()> {
    let mpath = dir.join(MANIFEST_FILE);
    let listed: Vec<String> = match outdir::read_manifest(dir) {
        Ok((m, _)) if m.format == MODEL_FORMAT => m.files.into_keys().collect(),
        _ if !present(&mpath) => Vec::new(),
        Ok((m, _)) => bail!(Config,
            "save_model: {} is the manifest of a {:?}, not of a tinyllm model folder: tinyllm does not replace it; save the model elsewhere",
            mpath.display(),
            m.format
        ),
        Err(e) => bail!(Config,
            "save_model: {} exists but is not a tinyllm manifest ({e}): tinyllm does not replace it; move it, or save the model elsewhere",
            mpath.display()
        ),
    };
    for name in files.iter().map(|(n, _)| *n).chain([MANIFEST_FILE]) {
        let p = dir.join(name);
        let Ok(meta) = p.symlink_metadata() else {
            continue;
        };
        let why = if meta.file_type().is_symlink() {
            "is a symbolic link (tinyllm never writes through or replaces a link)"
        } else if !meta.is_file() {
            "is not a regular file"
        } else if name != MANIFEST_FILE && !listed.iter().any(|l| l == name) {
            "was not written by tinyllm (no tinyllm manifest.json beside it lists it)"
        } else {
            continue;
        };
        bail!(Config,
            "save_model: {} {why}; tinyllm never overwrites a file it did not write: move it, or save the model elsewhere",
            p.display()
        );
    }
    Ok(())
}

/// Writes `files` and then their manifest into the (new, empty) `staging`.
fn stage(staging: &Path, files: &[(&str, Vec<u8>)], step: usize) -> Result<()> {
    // First the marker (created in place: until it exists the directory is
    // empty): a staging directory cut short, without its manifest, is still
    // recognisably tinyllm's, so the next save may clear it.
    let marker = staging.join(STAGING_MARKER);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&marker)
        .map_err(|e| io_err("cannot write", &marker, e))?;
    let mut manifest = Manifest {
        format: FORMAT.into(),
        files: BTreeMap::new(),
    };
    for (name, bytes) in files {
        write_atomic_at(staging, name, bytes, step)?;
        fault::pause_point(&format!("wrote:{name}"), step);
        manifest.files.insert(
            name.to_string(),
            FileEntry {
                sha256: Sha256::digest_hex(bytes),
                bytes: bytes.len() as u64,
            },
        );
    }
    let mbytes =
        serde_json::to_vec_pretty(&manifest).map_err(|e| Error::checkpoint(e.to_string()))?;
    write_atomic_at(staging, MANIFEST_FILE, &mbytes, step)?;
    fault::pause_point(&format!("wrote:{MANIFEST_FILE}"), step);
    // The manifest now marks the directory as tinyllm's.
    std::fs::remove_file(&marker).map_err(|e| io_err("cannot remove", &marker, e))?;
    sync_dir(staging);
    sync_dir(staging.parent().unwrap_or(staging));
    fault::pause_point("staged", step);
    Ok(())
}

/// Whether `dir` (a missing `checkpoint/`) is between [`swap`]'s two renames:
/// its run holds a `checkpoint.prev/` or `checkpoint.next/` beside it.
fn mid_swap(dir: &Path) -> bool {
    dir.file_name().is_some_and(|n| n == "checkpoint")
        && dir.parent().is_some_and(|r| {
            present(&r.join("checkpoint.prev")) || present(&r.join("checkpoint.next"))
        })
}

/// checkpoint -> checkpoint.prev, checkpoint.next -> checkpoint, then the
/// previous one removed.
fn swap(run_dir: &Path, staging: &Path, step: usize) -> Result<PathBuf> {
    let fin = run_dir.join("checkpoint");
    let prev = run_dir.join("checkpoint.prev");
    outdir::remove_ours(&prev)?;
    if present(&fin) {
        std::fs::rename(&fin, &prev).map_err(|e| io_err("cannot move aside", &fin, e))?;
    }
    fault::pause_point("swap", step);
    std::fs::rename(staging, &fin).map_err(|e| io_err("cannot move into place", staging, e))?;
    sync_dir(run_dir);
    fault::pause_point("swapped", step);
    let _ = outdir::remove_ours(&prev);
    Ok(fin)
}

/// A checkpoint's files, read and verified against its manifest.
pub struct Verified {
    /// The checkpoint directory itself (after [`resolve_dir`]).
    pub dir: PathBuf,
    files: HashMap<String, Vec<u8>>,
}

impl Verified {
    /// Reads `dir`'s manifest and every file it lists, checking sizes and
    /// hashes; every file must be a regular file (a FIFO or a device is
    /// refused before it is read, and no file is read past its recorded size).
    ///
    /// A run may be saving into the directory while it is read (its swap
    /// renames whole checkpoints, then deletes the old one): a read that fails
    /// after the checkpoint it started on was replaced starts again on the
    /// new one, so a healthy checkpoint is never reported as damaged.
    pub fn open(dir: &Path) -> Result<Verified> {
        const TRIES: usize = 200;
        for _ in 0..TRIES {
            let at = resolve_dir(dir);
            let (res, seen) = Self::read_once(dir, &at);
            let Err(e) = res else { return res };
            let now = resolve_dir(dir);
            let saving = !present(dir) && mid_swap(dir);
            let replaced =
                saving || now != at || outdir::read_manifest(&now).ok().map(|(_, b)| b) != seen;
            if !replaced {
                return Err(e);
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        bail!(Checkpoint,
            "{}: the checkpoint was replaced {TRIES} times while it was read (a run is saving into it at every step?); try again, or read a copy",
            dir.display()
        )
    }

    /// One attempt of [`open`](Verified::open) on the resolved `at`; also the
    /// manifest's bytes as read (`None`: unreadable).
    fn read_once(given: &Path, at: &Path) -> (Result<Verified>, Option<Vec<u8>>) {
        if !present(given) {
            let e = Error::checkpoint(format!("{}: no such checkpoint directory", given.display()));
            return (Err(e), None);
        }
        let mpath = at.join(MANIFEST_FILE);
        let (manifest, mbytes) = match outdir::read_manifest(at) {
            Ok(m) => m,
            Err(e) if !present(&mpath) => {
                let hf = if present(&at.join(CONFIG_FILE)) {
                    " — it holds a model without its training state (a Hugging Face folder?): `eval --data` and `generate` read it, a run resumes only from a checkpoint"
                } else {
                    ""
                };
                let e = Error::checkpoint(format!(
                    "{} is not a readable tinyllm checkpoint (no {MANIFEST_FILE}: {e}){hf}",
                    at.display()
                ));
                return (Err(e), None);
            }
            Err(e) => {
                let e = Error::checkpoint(format!("{}: {e} (a corrupt manifest)", mpath.display()));
                return (Err(e), None);
            }
        };
        let res = Self::read_files(at, &mpath, &manifest);
        (res, Some(mbytes))
    }

    fn read_files(dir: &Path, mpath: &Path, manifest: &Manifest) -> Result<Verified> {
        // A run's checkpoint, or a model folder (weights and config only);
        // either may hold the Hugging Face files beside the weights.
        let required: &[&str] = match manifest.format.as_str() {
            FORMAT => &[MODEL_FILE, CONFIG_FILE, OPTIM_FILE, STATE_FILE],
            MODEL_FORMAT => &[MODEL_FILE, CONFIG_FILE],
            _ => bail!(
                Checkpoint,
                "{}: unknown checkpoint format {:?} (expected {FORMAT:?}, or {MODEL_FORMAT:?} for a model folder)",
                mpath.display(),
                manifest.format
            ),
        };
        let known: Vec<&str> = required.iter().chain(&HF_FILES).copied().collect();
        if let Some(odd) = manifest.files.keys().find(|n| !known.contains(&n.as_str())) {
            bail!(
                Checkpoint,
                "{}: lists an unknown file {odd:?} (a {} holds {})",
                mpath.display(),
                if manifest.format == FORMAT {
                    "checkpoint"
                } else {
                    "model folder"
                },
                known.join(", ")
            );
        }
        if let Some(missing) = required.iter().find(|n| !manifest.files.contains_key(**n)) {
            bail!(
                Checkpoint,
                "{}: does not list {missing} (incomplete or corrupt manifest)",
                mpath.display()
            );
        }
        let mut files = HashMap::new();
        for (name, entry) in &manifest.files {
            let p = dir.join(name);
            // Sizes first (and only regular files), so a wrong file is
            // refused before it is read.
            let bytes = outdir::read_regular(&p, Some(entry.bytes), 0).map_err(|e| {
                Error::checkpoint(format!(
                    "checkpoint file missing or unreadable: {}: {e}; nothing was loaded",
                    p.display()
                ))
            })?;
            if Sha256::digest_hex(&bytes) != entry.sha256 {
                bail!(Checkpoint, "{}: SHA-256 does not match the manifest (the file is corrupted or was modified); nothing was loaded", p.display());
            }
            files.insert(name.clone(), bytes);
        }
        Ok(Verified {
            dir: dir.to_path_buf(),
            files,
        })
    }

    fn file(&self, name: &str) -> Result<&[u8]> {
        self.files.get(name).map(Vec::as_slice).ok_or_else(|| {
            if name == STATE_FILE || name == OPTIM_FILE {
                Error::checkpoint(format!(
                    "{} holds a model only (no {name}): it has no training state to resume, nor the run's held-out text to evaluate on (give eval --data FILE); a run's checkpoint is RUN_DIR/checkpoint",
                    self.dir.display()
                ))
            } else {
                Error::checkpoint(format!(
                    "{}: the manifest lists no {name}",
                    self.dir.display()
                ))
            }
        })
    }

    /// The model architecture from `config.json`.
    pub fn config(&self) -> Result<LlamaConfig> {
        let v: serde_json::Value = serde_json::from_slice(self.file(CONFIG_FILE)?)
            .map_err(|e| Error::checkpoint(format!("{}/{CONFIG_FILE}: {e}", self.dir.display())))?;
        let cfg = LlamaConfig::from_hf_json(&v).map_err(|e| e.context(self.dir.display()))?;
        crate::train::config::check_model_size(&cfg)
            .map_err(|e| e.context(format!("{}/{CONFIG_FILE}", self.dir.display())))?;
        let bytes = crate::train::data::ByteTokenizer::VOCAB;
        if cfg.vocab_size != bytes {
            bail!(Checkpoint,
                "{}/{CONFIG_FILE}: vocab_size {} cannot be used: tinyllm's tokenizer is bytes, {bytes} ids (0..={})",
                self.dir.display(),
                cfg.vocab_size,
                bytes - 1
            );
        }
        // A model far larger than the weights file that should hold it is
        // refused before it is allocated (the exact check is per tensor, later).
        let have = self.file(MODEL_FILE)?.len();
        if cfg.num_params().saturating_mul(4) > have.saturating_mul(4).saturating_add(64 << 20) {
            bail!(Checkpoint,
                "{}/{CONFIG_FILE}: describes {} parameters, far more than {MODEL_FILE} ({have} bytes) holds (config and weights do not match)",
                self.dir.display(),
                cfg.num_params()
            );
        }
        Ok(cfg)
    }

    /// A model's files for [`load_model`]: what [`open`](Self::open) reads,
    /// or, from a plain Hugging Face folder `dir` (a `config.json`, no
    /// manifest, no training state), its `config.json` and
    /// `model.safetensors` as they are (checked when they are parsed, not
    /// against hashes).
    pub fn open_model(dir: &Path) -> Result<Verified> {
        let plain = present(dir)
            && resolve_dir(dir) == dir
            && !present(&dir.join(MANIFEST_FILE))
            && present(&dir.join(CONFIG_FILE));
        if plain {
            return Self::read_plain(dir);
        }
        Self::open(dir)
    }

    fn read_plain(dir: &Path) -> Result<Verified> {
        for n in [STATE_FILE, OPTIM_FILE] {
            if present(&dir.join(n)) {
                bail!(Checkpoint,
                    "{} holds {n} but no {MANIFEST_FILE}: a tinyllm checkpoint whose manifest is missing, so its files cannot be checked; nothing was loaded",
                    dir.display()
                );
            }
        }
        let shards = "model.safetensors.index.json";
        if !present(&dir.join(MODEL_FILE)) && present(&dir.join(shards)) {
            bail!(
                Checkpoint,
                "{}: the weights are sharded ({shards}); tinyllm reads one {MODEL_FILE}",
                dir.display()
            );
        }
        let max_weights = (crate::train::config::MAX_MODEL_BYTES as u64).saturating_add(64 << 20);
        let mut files = HashMap::new();
        for (name, max) in [(CONFIG_FILE, MAX_CONFIG_BYTES), (MODEL_FILE, max_weights)] {
            let p = dir.join(name);
            let bytes = outdir::read_regular(&p, None, max).map_err(|e| {
                Error::checkpoint(format!(
                    "{}: no readable {name} beside {CONFIG_FILE} ({}: {e}); nothing was loaded",
                    dir.display(),
                    p.display()
                ))
            })?;
            files.insert(name.to_string(), bytes);
        }
        Ok(Verified {
            dir: dir.to_path_buf(),
            files,
        })
    }

    /// The [`TrainState`] from `trainer_state.json`, its run config
    /// validated. An error when the file does not parse, its format is not
    /// [`FORMAT`], its data fingerprint is not a SHA-256, or the config is
    /// invalid. (A checkpoint written before the schedule's length was
    /// recorded reads it as the run's `steps`.)
    pub fn train_state(&self) -> Result<TrainState> {
        let mut st: TrainState = serde_json::from_slice(self.file(STATE_FILE)?)
            .map_err(|e| Error::checkpoint(format!("{}/{STATE_FILE}: {e}", self.dir.display())))?;
        if st.format != FORMAT {
            bail!(
                Checkpoint,
                "{}/{STATE_FILE}: unknown format {:?}",
                self.dir.display(),
                st.format
            );
        }
        if !is_sha256_hex(&st.data_fingerprint) {
            bail!(Checkpoint,
                "{}/{STATE_FILE}: data_fingerprint {:?} is not a SHA-256 (64 lowercase hex digits); the file is corrupt or was edited",
                self.dir.display(),
                st.data_fingerprint
            );
        }
        if st.config.schedule_steps == 0 {
            // Written before the schedule's length was its own field.
            st.config.schedule_steps = st.config.steps;
        }
        st.config.validate().map_err(|e| {
            e.context(format!(
                "{}/{STATE_FILE}: the saved run config is invalid",
                self.dir.display()
            ))
        })?;
        // Counters a run could have reached: AdamW's step counts never pass
        // the optimizer steps taken, which never pass the run's limit.
        let max = crate::train::config::MAX_STEPS;
        let field = |f: &str, v: u64, most: u64, what: &str| -> Result<()> {
            if v > most {
                bail!(Checkpoint,
                    "{}/{STATE_FILE}: {f} is {v}, more than {what} ({most}); the file is corrupt or was edited",
                    self.dir.display()
                );
            }
            Ok(())
        };
        field("step", st.step as u64, max as u64, "any run takes")?;
        for (i, k) in st.adam_steps.iter().enumerate() {
            if let Some(k) = *k {
                field(
                    &format!("adam_steps[{i}]"),
                    k,
                    st.step as u64,
                    "the optimizer steps the run has taken",
                )?;
            }
        }
        Ok(st)
    }

    /// The tensors of `file`, each checked against `expected` (names, float32,
    /// shapes): exactly the expected set, nothing missing, nothing extra.
    fn tensors(&self, file: &str, expected: &[(String, Vec<usize>)]) -> Result<Vec<Vec<f32>>> {
        let where_ = format!("{}/{file}", self.dir.display());
        let st = SafeTensors::deserialize(self.file(file)?).map_err(|e| {
            Error::checkpoint(format!("{where_}: not a valid safetensors file ({e})"))
        })?;
        let want: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        if let Some(extra) = st.names().into_iter().find(|n| !want.contains(n)) {
            bail!(
                Checkpoint,
                "{where_}: unexpected tensor {extra:?} (does the config match the weights?)"
            );
        }
        let mut out = Vec::with_capacity(expected.len());
        for (name, shape) in expected {
            let t = st
                .tensor(name)
                .map_err(|_| Error::checkpoint(format!("{where_}: missing tensor {name:?}")))?;
            if t.dtype() != Dtype::F32 {
                bail!(
                    Checkpoint,
                    "{where_}: tensor {name:?} is {:?}, expected F32",
                    t.dtype()
                );
            }
            if t.shape() != shape.as_slice() {
                bail!(
                    Checkpoint,
                    "{where_}: tensor {name:?} has shape {:?}, the model expects {shape:?}",
                    t.shape()
                );
            }
            let v: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                bail!(Checkpoint,
                    "{where_}: tensor {name:?} holds a non-finite value ({} at index {i}); a tinyllm checkpoint never does (the file was changed or written by another tool); nothing was loaded",
                    v[i]
                );
            }
            out.push(v);
        }
        Ok(out)
    }

    /// Weights for `model` (validated, not yet assigned), after checking that
    /// `config.json` describes exactly `model.cfg`.
    pub fn weights_for(&self, model: &Llama) -> Result<Vec<Vec<f32>>> {
        let cfg = self.config()?;
        if cfg != model.cfg {
            bail!(
                Checkpoint,
                "{}: config.json does not match the model (checkpoint {:?}, model {:?})",
                self.dir.display(),
                cfg,
                model.cfg
            );
        }
        self.tensors(MODEL_FILE, &model.expected_shapes())
    }
}

fn assign(t: &Tensor, v: Vec<f32>, device: Device) -> Result<()> {
    t.set_storage(Storage::from_f32(v, device)?)
}

/// Builds the model a folder describes and loads its weights, on `device`:
/// a model folder ([`save_model`]'s), a run's checkpoint (`RUN_DIR` or
/// `RUN_DIR/checkpoint`), or a plain Hugging Face folder (`config.json` and
/// a float32 `model.safetensors`, no manifest). A manifest, when there is
/// one, is checked first (every file's size and SHA-256); then the config
/// and every tensor's name, dtype and shape. Every error names `dir`.
pub fn load_model(dir: &Path, device: Device) -> Result<Llama> {
    load_model_from(dir, device).map_err(|e| {
        let d = dir.display().to_string();
        if e.to_string().contains(&d) {
            e
        } else {
            e.context(d)
        }
    })
}

fn load_model_from(dir: &Path, device: Device) -> Result<Llama> {
    let ck = Verified::open_model(dir)?;
    let cfg = ck.config()?;
    // The weights twice at most (the file's values, then the model's).
    let need = 8 * cfg.num_params() as u64;
    if let Some(have) = crate::train::plan::host_available().filter(|&h| need > h) {
        bail!(Config,
            "{}: the model's {} parameters need {} MiB to load, but only {} MiB of host memory is available",
            ck.dir.display(),
            cfg.num_params(),
            need >> 20,
            have >> 20
        );
    }
    let model = Llama::new(&cfg, 0, device)?;
    let weights = ck.weights_for(&model)?;
    for (p, w) in model.parameters().iter().zip(weights) {
        assign(p, w, device)?;
    }
    Ok(model)
}

/// Restores weights, AdamW moments and step counts from a verified checkpoint
/// into `model` and `opt`; returns the trainer state. Everything is read and
/// checked before the first value is assigned.
pub fn restore(ck: &Verified, model: &Llama, opt: &mut AdamW) -> Result<TrainState> {
    let st = ck.train_state()?;
    let weights = ck.weights_for(model)?;
    let named = model.named_parameters();
    if st.adam_steps.len() != named.len() {
        bail!(
            Checkpoint,
            "{}/{STATE_FILE}: optimizer state for {} parameters, the model has {}",
            ck.dir.display(),
            st.adam_steps.len(),
            named.len()
        );
    }
    let mut expected = Vec::new();
    for ((n, t), s) in named.iter().zip(&st.adam_steps) {
        if s.is_some() {
            expected.push((format!("{n}.exp_avg"), t.shape().to_vec()));
            expected.push((format!("{n}.exp_avg_sq"), t.shape().to_vec()));
        }
    }
    let mut moments = ck.tensors(OPTIM_FILE, &expected)?.into_iter();
    let device = model.device();
    // Build every optimizer-state tensor first (allocation can fail), then assign.
    let mut states = Vec::with_capacity(named.len());
    for ((_, t), s) in named.iter().zip(&st.adam_steps) {
        states.push(match s {
            Some(k) => {
                let m = Tensor::from_vec(moments.next().unwrap(), t.shape(), device)?;
                let v = Tensor::from_vec(moments.next().unwrap(), t.shape(), device)?;
                Some((m, v, *k))
            }
            None => None,
        });
    }
    let weights: Vec<Storage> = weights
        .into_iter()
        .map(|w| Storage::from_f32(w, device))
        .collect::<Result<_>>()?;
    for ((_, p), w) in named.iter().zip(weights) {
        p.set_storage(w)?;
    }
    for (i, s) in states.into_iter().enumerate() {
        opt.set_state(i, s)?;
    }
    Ok(st)
}
