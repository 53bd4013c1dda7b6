//! Optimizers over float32 master weights: SGD, AdamW and gradient clipping.
//! Each update is fused and in place, on the parameters' device: AdamW's one
//! primitive for all its parameters (a GPU updates four a dispatch), SGD's
//! one per parameter.
//! Parameters whose gradient is absent are skipped.

use crate::backend::{AdamWConsts, AdamWItem, DType, Storage};
use crate::{bail, Result, Tensor};
use serde::{Deserialize, Serialize};

/// An optimizer owns the list of parameters it updates.
pub trait Optimizer {
    /// Applies one update from the current gradients, in place. Parameters
    /// with no gradient are skipped; errors if a parameter that has one is
    /// not float32.
    fn step(&mut self) -> Result<()>;
    /// The parameters it updates, in the order it was given them.
    fn params(&self) -> &[Tensor];
    /// The current learning rate.
    fn lr(&self) -> f32;
    /// Sets the learning rate for the following steps (a schedule calls this
    /// before each step).
    fn set_lr(&mut self, lr: f32);
    /// [`step`](Self::step) after multiplying every gradient of its
    /// parameters by `c` in place (clipping), which they keep: the bits of
    /// scaling each gradient, then stepping. AdamW does both in one pass.
    fn step_scaled(&mut self, c: f32) -> Result<()> {
        scale_grads(self.params(), c)?;
        self.step()
    }
    /// Clears every parameter's gradient.
    fn zero_grad(&self) {
        for p in self.params() {
            p.zero_grad();
        }
    }
}

fn check_master(p: &Tensor) -> Result<()> {
    if p.dtype() != DType::F32 {
        bail!(
            DType,
            "optimizers update float32 master weights; got a {:?} parameter",
            p.dtype()
        );
    }
    Ok(())
}

/// SGD with optional momentum and (coupled) weight decay, PyTorch's formula.
pub struct Sgd {
    params: Vec<Tensor>,
    /// The learning rate.
    pub lr: f32,
    /// The momentum factor (0: plain SGD, no momentum buffer).
    pub momentum: f32,
    /// The L2 penalty added to the gradient (`g + weight_decay · p`) before
    /// momentum.
    pub weight_decay: f32,
    bufs: Vec<Option<Tensor>>,
}

impl Sgd {
    /// An SGD optimizer over `params`. The momentum buffer of a parameter is
    /// its first gradient, then `momentum · buf + g`. Errors
    /// ([`Error::Config`](crate::Error::Config)) if `lr`, `momentum` or
    /// `weight_decay` is negative or NaN.
    pub fn new(params: Vec<Tensor>, lr: f32, momentum: f32, weight_decay: f32) -> Result<Sgd> {
        if !(lr >= 0.0) || !(momentum >= 0.0) || !(weight_decay >= 0.0) {
            bail!(
                Config,
                "SGD: lr, momentum and weight decay must be non-negative"
            );
        }
        let n = params.len();
        Ok(Sgd {
            params,
            lr,
            momentum,
            weight_decay,
            bufs: vec![None; n],
        })
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        for (p, buf) in self.params.iter().zip(self.bufs.iter_mut()) {
            let Some(g) = p.grad() else { continue };
            check_master(p)?;
            if self.momentum == 0.0 {
                p.storage()
                    .sgd_step(&g.storage(), None, self.lr, 0.0, self.weight_decay, true)?;
            } else {
                let first = buf.is_none();
                let b = match buf {
                    Some(b) => b.clone(),
                    None => buf.insert(p.zeros_like()?).clone(),
                };
                p.storage().sgd_step(
                    &g.storage(),
                    Some(&b.storage()),
                    self.lr,
                    self.momentum,
                    self.weight_decay,
                    first,
                )?;
            }
        }
        Ok(())
    }
    fn params(&self) -> &[Tensor] {
        &self.params
    }
    fn lr(&self) -> f32 {
        self.lr
    }
    fn set_lr(&mut self, lr: f32) {
        self.lr = lr;
    }
}

/// AdamW hyper-parameters (PyTorch's defaults but the learning rate).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// The learning rate.
    pub lr: f32,
    /// The first moment's decay rate, in `[0, 1)` (default 0.9).
    pub beta1: f32,
    /// The second moment's decay rate, in `[0, 1)` (default 0.999).
    pub beta2: f32,
    /// Added to `√v̂` in the denominator, `> 0` (default 1e-8).
    pub eps: f32,
    /// Decoupled weight decay: each step first multiplies the parameter by
    /// `1 − lr · weight_decay` (default 0.01).
    pub weight_decay: f32,
}

impl AdamWConfig {
    /// The defaults with learning rate `lr`: betas (0.9, 0.999), eps 1e-8,
    /// weight decay 0.01.
    pub fn new(lr: f32) -> Self {
        AdamWConfig {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// AdamW: decoupled weight decay, bias-corrected moments (PyTorch's formula).
/// Moments are float32 tensors on the parameter's device.
pub struct AdamW {
    params: Vec<Tensor>,
    /// The hyper-parameters; changes apply from the next step.
    pub cfg: AdamWConfig,
    /// Per parameter: (m, v, step count), created at its first update.
    state: Vec<Option<(Tensor, Tensor, u64)>>,
}

impl AdamW {
    /// An AdamW optimizer over `params`, its moments created at each
    /// parameter's first update. Errors ([`Error::Config`](crate::Error::Config))
    /// unless `lr >= 0`, both betas are in `[0, 1)`, `eps > 0` and
    /// `weight_decay >= 0`.
    pub fn new(params: Vec<Tensor>, cfg: AdamWConfig) -> Result<AdamW> {
        if !(cfg.lr >= 0.0)
            || !(0.0..1.0).contains(&cfg.beta1)
            || !(0.0..1.0).contains(&cfg.beta2)
            || !(cfg.eps > 0.0)
            || !(cfg.weight_decay >= 0.0)
        {
            bail!(
                Config,
                "AdamW: need lr >= 0, betas in [0, 1), eps > 0, weight decay >= 0 (got {cfg:?})"
            );
        }
        let n = params.len();
        Ok(AdamW {
            params,
            cfg,
            state: vec![None; n],
        })
    }

    /// The parameters it updates, in the order it was given them.
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// The moments `(m, v)` and step count of parameter `i`, if it has been
    /// updated (`None` also for an `i` out of range).
    pub fn state(&self, i: usize) -> Option<&(Tensor, Tensor, u64)> {
        self.state.get(i).and_then(|s| s.as_ref())
    }

    /// Replaces the state of parameter `i` (resuming from a checkpoint);
    /// `None` makes its next update the first. Errors if there is no parameter
    /// `i` or the moments' shapes differ from the parameter's.
    pub fn set_state(&mut self, i: usize, st: Option<(Tensor, Tensor, u64)>) -> Result<()> {
        let p = self
            .params
            .get(i)
            .ok_or_else(|| crate::Error::config(format!("no parameter {i}")))?;
        if let Some((m, v, _)) = &st {
            if m.shape() != p.shape() || v.shape() != p.shape() {
                bail!(
                    Config,
                    "optimizer state {i}: moments of shape {:?}/{:?} for a parameter of shape {:?}",
                    m.shape(),
                    v.shape(),
                    p.shape()
                );
            }
        }
        self.state[i] = st;
        Ok(())
    }
}

impl AdamW {
    /// One update, each gradient first multiplied by `grad_scale` (if set)
    /// inside the update's own pass.
    fn update(&mut self, grad_scale: Option<f32>) -> Result<()> {
        let c = self.cfg;
        lay_out_grads(&self.params)?;
        // the parameters with a gradient, checked before anything is made
        let with_grad: Vec<(usize, Tensor)> = (self.params.iter().enumerate())
            .filter_map(|(i, p)| p.grad().map(|g| (i, g)))
            .collect();
        for (i, _) in &with_grad {
            check_master(&self.params[*i])?;
        }
        // first updates: both moments made laid out like their parameters
        let fresh: Vec<usize> = (with_grad.iter().map(|(i, _)| *i))
            .filter(|&i| self.state[i].is_none())
            .collect();
        let like: Vec<&Tensor> = fresh.iter().map(|&i| &self.params[i]).collect();
        let (ms, vs) = (
            Tensor::zeros_laid_out(&like)?,
            Tensor::zeros_laid_out(&like)?,
        );
        for ((i, m), v) in fresh.into_iter().zip(ms).zip(vs) {
            self.state[i] = Some((m, v, 0));
        }
        let mut todo = Vec::new();
        for (i, g) in with_grad {
            let (_, _, t) = self.state[i].as_mut().expect("made above");
            *t += 1;
            // Scalars in f64 on the host, narrowed once: both backends get the same bits.
            let (b1, b2) = (c.beta1 as f64, c.beta2 as f64);
            let bc1 = 1.0 - b1.powi(*t as i32);
            let bc2 = 1.0 - b2.powi(*t as i32);
            let k = AdamWConsts {
                decay: (1.0 - c.lr as f64 * c.weight_decay as f64) as f32,
                beta1: c.beta1,
                omb1: (1.0 - b1) as f32,
                beta2: c.beta2,
                omb2: (1.0 - b2) as f32,
                step_size: (c.lr as f64 / bc1) as f32,
                bc2_sqrt: bc2.sqrt() as f32,
                eps: c.eps,
                grad_scale,
            };
            todo.push((i, g.storage(), k));
        }
        self.lay_out()?;
        let held: Vec<(usize, [Storage; 3], Storage, AdamWConsts)> = todo
            .into_iter()
            .map(|(i, g, k)| {
                let (m, v, _) = self.state[i].as_ref().expect("made above");
                (
                    i,
                    [self.params[i].storage(), m.storage(), v.storage()],
                    g,
                    k,
                )
            })
            .collect();
        let items: Vec<AdamWItem<'_, Storage>> = held
            .iter()
            .map(|(_, [p, m, v], g, k)| AdamWItem { p, g, m, v, c: *k })
            .collect();
        Storage::adamw_many(&items, |j| {
            Some(crate::trace::path_with(|| format!("params.{}", held[j].0)))
        })
    }

    /// Once every parameter has its moments: the parameters, the first
    /// moments and the second moments each laid side by side in one buffer,
    /// alike ([`Tensor::colocate`]; where that gains nothing, as on the CPU,
    /// nothing moves), so that a GPU updates several parameters a dispatch.
    /// Done at the first update and again after anything replaces a buffer
    /// (a checkpoint load); the updates are in place.
    fn lay_out(&self) -> Result<()> {
        let moments: Option<Vec<(&Tensor, &Tensor)>> = self
            .state
            .iter()
            .map(|s| s.as_ref().map(|(m, v, _)| (m, v)))
            .collect();
        let Some(moments) = moments else {
            return Ok(());
        };
        let (ms, vs): (Vec<&Tensor>, Vec<&Tensor>) = moments.into_iter().unzip();
        let ps: Vec<&Tensor> = self.params.iter().collect();
        for group in [&ps, &ms, &vs] {
            if !Tensor::side_by_side(group) {
                Tensor::colocate(group)?;
            }
        }
        Ok(())
    }
}

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        self.update(None)
    }
    fn step_scaled(&mut self, c: f32) -> Result<()> {
        self.update(Some(c))
    }
    fn params(&self) -> &[Tensor] {
        &self.params
    }
    fn lr(&self) -> f32 {
        self.cfg.lr
    }
    fn set_lr(&mut self, lr: f32) {
        self.cfg.lr = lr;
    }
}

/// The gradients of `params` laid side by side as their parameters are
/// ([`Tensor::colocate_each_step`]: on a GPU, views of one buffer, copied there by the
/// device; elsewhere nothing moves), so that the loss scaler's check and
/// AdamW take them all in one dispatch each. Values are untouched.
pub(crate) fn lay_out_grads(params: &[Tensor]) -> Result<()> {
    let grads: Vec<Tensor> = params.iter().filter_map(|p| p.grad()).collect();
    let refs: Vec<&Tensor> = grads.iter().collect();
    if !Tensor::side_by_side(&refs) {
        Tensor::colocate_each_step(&refs)?;
    }
    Ok(())
}

/// The buffers of the parameters' gradients, in parameter order (those with
/// none are left out): what the scaler checks, clipping measures and scales.
pub(crate) fn grad_storages(params: &[Tensor]) -> Vec<Storage> {
    params
        .iter()
        .filter_map(|p| p.grad().map(|g| g.storage()))
        .collect()
}

/// Clips the global L2 norm of all gradients to `max_norm` in place and
/// returns the norm before clipping: when it exceeds `max_norm` every gradient
/// is multiplied by `max_norm / (norm + 1e-6)`. Parameters without a gradient
/// are left out (none at all gives a norm of 0). Errors if `max_norm` is not
/// positive.
pub fn clip_grad_norm_(params: &[Tensor], max_norm: f32) -> Result<f32> {
    let grads = grad_storages(params);
    let refs: Vec<&Storage> = grads.iter().collect();
    let (norm, coef) = clip_coef(Storage::sum_squares(&refs)?, max_norm)?;
    if let Some(c) = coef {
        scale_grads(params, c)?;
    }
    Ok(norm)
}

/// Every gradient of `params` multiplied by `c` in place.
fn scale_grads(params: &[Tensor], c: f32) -> Result<()> {
    for g in grad_storages(params) {
        g.scale_in_place(c)?;
    }
    Ok(())
}

/// The global norm from its square, and the factor clipping multiplies the
/// gradients by (none when the norm is within `max_norm`).
fn clip_coef(sum_squares: f32, max_norm: f32) -> Result<(f32, Option<f32>)> {
    if !(max_norm > 0.0) {
        bail!(Config, "clip: max_norm must be positive, got {max_norm}");
    }
    let norm = crate::backend::math::sqrt(sum_squares);
    let coef = (norm > max_norm).then(|| crate::backend::math::div(max_norm, norm + 1e-6));
    Ok((norm, coef))
}

/// A training step's end: [`clip_grad_norm_`] of `params`, its norm measured
/// already (`sum_squares`), when `clip` is set; then `opt`'s update; returns
/// the norm. When `opt` updates exactly `params`, the clip's scaling runs
/// inside the update
/// ([`Optimizer::step_scaled`]: on the GPU the AdamW kernels alone
/// instead of a scaling kernel and an update) — the same bits.
pub(crate) fn clip_and_step(
    opt: &mut dyn Optimizer,
    params: &[Tensor],
    sum_squares: f32,
    clip: Option<f32>,
) -> Result<Option<f32>> {
    let Some(max_norm) = clip else {
        opt.step()?;
        return Ok(None);
    };
    let (norm, coef) = clip_coef(sum_squares, max_norm)?;
    let same = |a: &[Tensor], b: &[Tensor]| {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.id() == y.id())
    };
    match coef {
        None => opt.step()?,
        Some(c) if same(opt.params(), params) => opt.step_scaled(c)?,
        Some(c) => {
            scale_grads(params, c)?;
            opt.step()?;
        }
    }
    Ok(Some(norm))
}
