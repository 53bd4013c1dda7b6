//! Checkpoints: `DIR/checkpoint/` holds
//!
//! * `model.safetensors` — the weights under Hugging Face `LlamaForCausalLM`
//!   names (`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`,
//!   …, `lm_head.weight`), float32;
//! * `config.json` — the matching HF `LlamaConfig`;
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
//! (see [`outdir`]).
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
use crate::optim::AdamW;
use crate::precision::ScalerState;
use crate::rng::RngState;
use crate::train::config::TrainConfig;
use crate::train::fault;
use crate::train::outdir::{self, DirLock, FileEntry, Manifest, STAGING_MARKER};
use crate::train::outdir::{present, sync_dir};
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

/// Everything but tensors that a resumed run needs to continue bit for bit.
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

struct F32View {
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl safetensors::View for F32View {
    fn dtype(&self) -> Dtype {
        Dtype::F32
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

fn view(t: &Tensor) -> Result<F32View> {
    let v = t.to_vec_f32()?;
    Ok(F32View {
        shape: t.shape().to_vec(),
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    })
}

fn serialize(tensors: Vec<(String, F32View)>, meta: HashMap<String, String>) -> Result<Vec<u8>> {
    safetensors::serialize(tensors, Some(meta))
        .map_err(|e| Error::checkpoint(format!("safetensors: {e}")))
}

/// Where a checkpoint lives: `dir` itself when it holds a manifest, else
/// `dir/checkpoint`; after a crash between [`save`]'s two renames (no
/// `checkpoint/`, but a `checkpoint.prev/`), the complete `checkpoint.next/`
/// (or, failing that, `checkpoint.prev/`).
pub fn resolve_dir(dir: &Path) -> PathBuf {
    if dir.join(MANIFEST_FILE).exists() {
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
fn first_non_finite(tensors: &[(String, F32View)]) -> Option<&str> {
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
pub fn save(run_dir: &Path, model: &Llama, opt: &AdamW, state: &TrainState) -> Result<PathBuf> {
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
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let named = model.named_parameters();
    let weights: Vec<(String, F32View)> = named
        .iter()
        .map(|(n, t)| Ok((n.clone(), view(t)?)))
        .collect::<Result<_>>()?;
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
    let json = |v: &serde_json::Value| {
        serde_json::to_vec_pretty(v).map_err(|e| Error::checkpoint(e.to_string()))
    };
    Ok(vec![
        (MODEL_FILE, serialize(weights, meta.clone())?),
        (CONFIG_FILE, json(&model.cfg.to_hf_json())?),
        (OPTIM_FILE, serialize(moments, meta)?),
        (
            STATE_FILE,
            serde_json::to_vec_pretty(state).map_err(|e| Error::checkpoint(e.to_string()))?,
        ),
    ])
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
                let e = Error::checkpoint(format!(
                    "{} is not a readable tinyllm checkpoint (no {MANIFEST_FILE}: {e})",
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
        if manifest.format != FORMAT {
            bail!(
                Checkpoint,
                "{}: unknown checkpoint format {:?} (expected {FORMAT:?})",
                mpath.display(),
                manifest.format
            );
        }
        const KNOWN: [&str; 4] = [MODEL_FILE, CONFIG_FILE, OPTIM_FILE, STATE_FILE];
        if let Some(odd) = manifest.files.keys().find(|n| !KNOWN.contains(&n.as_str())) {
            bail!(
                Checkpoint,
                "{}: lists an unknown file {odd:?} (a checkpoint holds {})",
                mpath.display(),
                KNOWN.join(", ")
            );
        }
        if let Some(missing) = KNOWN.iter().find(|n| !manifest.files.contains_key(**n)) {
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
            Error::checkpoint(format!(
                "{}: the manifest lists no {name}",
                self.dir.display()
            ))
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

    /// The [`TrainState`] from `trainer_state.json`, its run config
    /// validated. An error when the file does not parse, its format is not
    /// [`FORMAT`], or the config is invalid. (A checkpoint written before the
    /// schedule's length was recorded reads it as the run's `steps`.)
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

/// Builds the model a checkpoint describes and loads its weights (for `eval`
/// and `generate`).
pub fn load_model(dir: &Path, device: Device) -> Result<Llama> {
    let ck = Verified::open(dir)?;
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
