//! One optimizer step in mixed precision (spec L11.1): gradient accumulation
//! over micro-batches and `train_step_mixed`, which reads top to bottom like
//! nanoGPT's loop — zero → (scale → backward) per micro-batch → unscale and
//! check → clip → step → update the scale. Built on
//! [`precision`](crate::precision)'s `autocast` and `DynamicLossScaler`.

use crate::backend::Storage;
use crate::optim::{clip_grad_norm_, grad_storages, Optimizer};
use crate::precision::{autocast, DynamicLossScaler, Precision};
use crate::{bail, Result, Tensor};
use serde::{Deserialize, Serialize};

/// A micro-batch knows how many rows (examples) it holds: the weight `n_i / N`.
pub trait MicroBatch {
    fn rows(&self) -> usize;
}

impl MicroBatch for (Tensor, Tensor) {
    fn rows(&self) -> usize {
        self.0.shape().first().copied().unwrap_or(1)
    }
}

/// Backpropagates `(n_i / N) · L_i` for every micro-batch (times `S` when a
/// scaler is given) without zeroing in between, so the gradients add up to
/// exactly the gradient of one batch of `N` rows. Returns the weighted loss
/// `Σ (n_i / N) L_i` (unscaled): the loss of that one batch.
pub fn grad_accumulate<M: ?Sized, B: MicroBatch>(
    _model: &M,
    micro_batches: &[B],
    loss_fn: impl FnMut(&B) -> Result<Tensor>,
    scaler: Option<&DynamicLossScaler>,
) -> Result<f32> {
    let losses = backward_all(micro_batches, loss_fn, scaler)?;
    losses.total(&losses.values.to_vec_f64()?)
}

/// The micro-batches' losses, still on the device, and their weights.
struct Losses {
    weights: Vec<f64>,
    /// `(micro-batches,)`: each micro-batch's unweighted, unscaled loss.
    values: Tensor,
}

impl Losses {
    /// `Σ (n_i / N) L_i` from the values read back, in f64.
    fn total(&self, values: &[f64]) -> Result<f32> {
        if values.len() != self.weights.len() {
            bail!(
                Device,
                "read back {} losses for {} micro-batches",
                values.len(),
                self.weights.len()
            );
        }
        let sum = self
            .weights
            .iter()
            .zip(values)
            .fold(0.0f64, |acc, (w, &v)| acc + w * v);
        Ok(sum as f32)
    }
}

/// [`grad_accumulate`]'s backward passes; the losses stay on the device, to
/// come back in the step's one readback, not one per micro-batch (each is a
/// GPU sync).
fn backward_all<B: MicroBatch>(
    micro_batches: &[B],
    mut loss_fn: impl FnMut(&B) -> Result<Tensor>,
    scaler: Option<&DynamicLossScaler>,
) -> Result<Losses> {
    let total: usize = micro_batches.iter().map(|b| b.rows()).sum();
    if total == 0 {
        bail!(Shape, "grad_accumulate: no rows in the micro-batches");
    }
    let (mut weights, mut values) = (Vec::new(), Vec::new());
    for mb in micro_batches {
        let w = mb.rows() as f64 / total as f64;
        let li = loss_fn(mb)?;
        let weighted = li.mul_scalar(w)?;
        weights.push(w);
        values.push(li.detach().reshape(&[1])?);
        match scaler {
            Some(s) => s.scale_loss(&weighted)?.backward()?,
            None => weighted.backward()?,
        }
    }
    let parts: Vec<&Tensor> = values.iter().collect();
    Ok(Losses {
        weights,
        values: Tensor::cat(&parts, 0)?,
    })
}

/// What one mixed-precision step did.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// The batch's loss (weighted over micro-batches, unscaled).
    pub loss: f32,
    /// True when the scaler skipped the update (non-finite gradients).
    pub skipped: bool,
    /// The loss scale after the step (1 without a scaler).
    pub scale: f32,
    /// The global gradient norm before clipping, when clipping was asked for.
    pub grad_norm: Option<f32>,
}

/// Spec L0.5's `train_step` for mixed precision: zero the gradients,
/// accumulate the micro-batches under `autocast(precision)` (none for fp32:
/// an enclosing autocast stays in force, as the spec says), then either the
/// scaler's step, or a finite-loss check (an error before any update, the
/// gradients dropped), clipping and the optimizer's step.
pub fn train_step_mixed<M: crate::nn::Module + ?Sized, B: MicroBatch>(
    model: &M,
    micro_batches: &[B],
    loss_fn: impl FnMut(&B) -> Result<Tensor>,
    opt: &mut dyn Optimizer,
    precision: Precision,
    scaler: Option<&mut DynamicLossScaler>,
    clip: Option<f32>,
) -> Result<StepReport> {
    let params = model.parameters();
    for p in &params {
        p.zero_grad();
    }
    let losses = {
        let _ac = precision.format().map(autocast);
        backward_all(micro_batches, loss_fn, scaler.as_deref())?
    };
    // The losses come back with the gradients' finite check: one readback.
    let loss_values = losses.values.storage();
    let _traced = crate::crosscheck::trace::phase("optimizer");
    match scaler {
        Some(s) => {
            let (stepped, values) = s.step_reading(opt, &params, clip, Some(&loss_values))?;
            Ok(StepReport {
                loss: losses.total(&values)?,
                skipped: !stepped,
                scale: s.loss_scale(),
                grad_norm: s.last_grad_norm(),
            })
        }
        None => {
            // A finite loss can still have non-finite gradients (an op whose
            // derivative blows up); clipping or AdamW would spread them into
            // every weight. The scaler's fused check with a scale of 1 (an
            // exact no-op multiply) finds them in one pass.
            let grads = grad_storages(&params);
            let refs: Vec<&Storage> = grads.iter().collect();
            let (finite, values) =
                Storage::finite_check_unscale_reading(&refs, 1.0, Some(&loss_values))?;
            let loss = losses.total(&values)?;
            if !loss.is_finite() || !finite {
                for p in &params {
                    p.zero_grad();
                }
                let what = if loss.is_finite() {
                    "gradients"
                } else {
                    "loss"
                };
                bail!(
                    Numerical,
                    "non-finite {what} (loss {loss}) without a loss scaler: no update was made"
                );
            }
            let grad_norm = match clip {
                Some(c) => Some(clip_grad_norm_(&params, c)?),
                None => None,
            };
            opt.step()?;
            Ok(StepReport {
                loss,
                skipped: false,
                scale: 1.0,
                grad_norm,
            })
        }
    }
}
