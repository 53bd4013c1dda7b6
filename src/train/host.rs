//! A model and its optimizer as plain host values, so training can move to
//! another thread and back.
//!
//! A [`Tensor`], and so a [`Llama`], is not `Send`: its
//! storage, gradient and graph node sit behind reference counts and cells
//! that one thread owns, and autocast and grad mode are per thread. Making
//! every tensor `Send` (an atomic count and a lock on every access of the
//! graph) costs little time but would let two threads share one graph, its
//! per-thread memory counts and one GPU command batch in no defined order —
//! see "Why `Tensor` is not `Send`" in BENCHMARKS.md. What a server or a GUI
//! needs is to hand a whole training job to a worker. [`HostState`] is that job at rest: the configuration, every
//! weight, the dropout stream and AdamW's moments as `Vec`s. Moving a model
//! through it changes no bit — the steps after it are the steps that would
//! have followed.
//!
//! ```
//! use tinyllm::nn::{llama::{Llama, LlamaConfig}, Module};
//! use tinyllm::optim::{AdamW, AdamWConfig};
//! use tinyllm::train::HostState;
//! use tinyllm::Device;
//!
//! let model = Llama::new(&LlamaConfig::preset("tiny")?, 0, Device::Cpu)?;
//! let opt = AdamW::new(model.parameters(), AdamWConfig::new(1e-3))?;
//! let job = HostState::new(&model, Some(&opt))?;
//! let job = std::thread::spawn(move || -> tinyllm::Result<HostState> {
//!     let (model, opt) = job.into_model(Device::Cpu)?;
//!     // ... train `model` with `opt` here ...
//!     HostState::new(&model, opt.as_ref())
//! })
//! .join()
//! .expect("the worker finished")?;
//! let (model, _opt) = job.into_model(Device::Cpu)?;
//! # let _ = model;
//! # Ok::<(), tinyllm::Error>(())
//! ```

use crate::nn::llama::{Llama, LlamaConfig};
use crate::nn::Module;
use crate::optim::{AdamW, AdamWConfig};
use crate::rng::RngState;
use crate::{Device, Result, Tensor};

/// A [`Llama`] (and optionally its [`AdamW`]) copied to host memory: `Send`.
#[derive(Clone, Debug)]
pub struct HostState {
    /// The model's configuration.
    pub config: LlamaConfig,
    /// Its activation-recompute budget ([`Llama::recompute`]).
    pub recompute: Option<usize>,
    /// Whether it recomputes its attention cores ([`Llama::attention_recompute`]).
    pub attention_recompute: bool,
    /// Every parameter by its Hugging Face name, in [`Module::parameters`]
    /// order, as float32 values.
    pub weights: Vec<(String, Vec<f32>)>,
    /// The dropout stream's state ([`Llama::rng`]).
    pub dropout_rng: RngState,
    /// The optimizer, if one was given.
    pub adamw: Option<HostAdamW>,
}

/// An [`AdamW`]'s settings and per-parameter state on the host.
#[derive(Clone, Debug)]
pub struct HostAdamW {
    /// Its hyper-parameters.
    pub cfg: AdamWConfig,
    /// Per parameter, in the model's parameter order: its moments, or
    /// `None` before its first update.
    pub moments: Vec<Option<Moments>>,
}

/// One parameter's AdamW state: `(m, v, steps)`.
pub type Moments = (Vec<f32>, Vec<f32>, u64);

impl HostState {
    /// Copies `model` (and `opt`, whose parameters must be the model's, in
    /// order) to the host. Waits for the device where they live.
    pub fn new(model: &Llama, opt: Option<&AdamW>) -> Result<HostState> {
        let named = model.named_parameters();
        let weights = named
            .iter()
            .map(|(n, t)| Ok((n.clone(), t.to_vec_f32()?)))
            .collect::<Result<Vec<_>>>()?;
        let adamw = match opt {
            None => None,
            Some(o) => {
                let same = o.params().len() == named.len()
                    && o.params().iter().zip(&named).all(|(a, (_, b))| a.same(b));
                if !same {
                    crate::bail!(
                        Config,
                        "HostState::new: the optimizer does not update this model's parameters, in order"
                    );
                }
                let moments = (0..named.len())
                    .map(|i| {
                        o.state(i)
                            .map(|(m, v, k)| Ok((m.to_vec_f32()?, v.to_vec_f32()?, *k)))
                            .transpose()
                    })
                    .collect::<Result<Vec<_>>>()?;
                Some(HostAdamW {
                    cfg: o.cfg,
                    moments,
                })
            }
        };
        Ok(HostState {
            config: model.cfg.clone(),
            recompute: model.recompute(),
            attention_recompute: model.attention_recompute(),
            weights,
            dropout_rng: model.rng.state(),
            adamw,
        })
    }

    /// The model (and optimizer) again, on `device`: the same bits as when
    /// [`new`](Self::new) copied them. Errors if a weight's name or length
    /// does not fit the configuration.
    pub fn into_model(self, device: Device) -> Result<(Llama, Option<AdamW>)> {
        let model = Llama::new(&self.config, 0, device)?
            .with_recompute(self.recompute)?
            .with_attention_recompute(self.attention_recompute);
        let named = model.named_parameters();
        if named.len() != self.weights.len() {
            crate::bail!(
                Config,
                "HostState: {} weights for a model of {} parameters",
                self.weights.len(),
                named.len()
            );
        }
        for ((name, t), (wname, w)) in named.iter().zip(self.weights) {
            if *name != wname {
                crate::bail!(Config, "HostState: weight {wname} where {name} belongs");
            }
            t.assign(&Tensor::from_vec(w, t.shape(), device)?)
                .map_err(|e| e.context(format!("HostState: {name}")))?;
        }
        model.rng.set_state(self.dropout_rng);
        let opt = match self.adamw {
            None => None,
            Some(h) => {
                let mut opt = AdamW::new(model.parameters(), h.cfg)?;
                if h.moments.len() != named.len() {
                    crate::bail!(
                        Config,
                        "HostState: optimizer state for {} parameters, the model has {}",
                        h.moments.len(),
                        named.len()
                    );
                }
                for (i, (st, (_, p))) in h.moments.into_iter().zip(&named).enumerate() {
                    let st = match st {
                        None => None,
                        Some((m, v, k)) => Some((
                            Tensor::from_vec(m, p.shape(), device)?,
                            Tensor::from_vec(v, p.shape(), device)?,
                            k,
                        )),
                    };
                    opt.set_state(i, st)?;
                }
                Some(opt)
            }
        };
        Ok((model, opt))
    }
}
