//! One optimizer step in mixed precision: gradient accumulation
//! over micro-batches and `train_step_mixed`, which reads top to bottom like
//! nanoGPT's loop — zero → (scale → backward) per micro-batch → unscale and
//! check → clip → step → update the scale. Built on
//! [`precision`](crate::precision)'s `autocast` and `DynamicLossScaler`.

use crate::backend::Storage;
use crate::memory::{self, Phase};
use crate::optim::Optimizer;
use crate::precision::{
    autocast, CastPolicy, CastTable, DynamicLossScaler, LossScaling, Precision,
};
use crate::tensor::fp8::{fp8_scope, DelayedScaling};
use crate::{bail, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::rc::Rc;

/// A micro-batch knows how many rows (examples) it holds: the weight `n_i / N`.
pub trait MicroBatch {
    /// The rows (examples) in this micro-batch, `n_i`; the batch's `N` is
    /// their sum.
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
pub fn grad_accumulate<B: MicroBatch>(
    micro_batches: &[B],
    loss_fn: impl FnMut(&B) -> Result<Tensor>,
    scaler: Option<&DynamicLossScaler>,
) -> Result<f32> {
    let losses = backward_all(micro_batches, loss_fn, scaler)?;
    let parts: Vec<&Tensor> = losses.values.iter().collect();
    losses.total(&Tensor::cat(&parts, 0)?.to_vec_f64()?)
}

/// The micro-batches' losses, still on the device, and their weights.
struct Losses {
    weights: Vec<f64>,
    /// Each micro-batch's unweighted, unscaled loss, `(1,)`.
    values: Vec<Tensor>,
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
    let _update_after = UpdateAfter;
    for mb in micro_batches {
        let w = mb.rows() as f64 / total as f64;
        memory::enter(Phase::Forward);
        let li = loss_fn(mb)?;
        weights.push(w);
        values.push(li.detach().reshape(&[1])?);
        memory::enter(Phase::Backward);
        // The backward of S·((n_i/N)·L_i) (S = 1 without a scaler) from its
        // seed 1: the gradient reaching L_i is (1·S)·(n_i/N), each product
        // in f32 as the kernels of `scale_loss` and `mul_scalar` form it;
        // made here, it is no dispatch.
        let s = scaler.map_or(1.0, |s| s.loss_scale());
        let seed = li.full_like(((1.0f32 * s) * w as f32) as f64)?;
        li.backward_with(&seed)?;
    }
    Ok(Losses { weights, values })
}

/// Counts what follows the backward passes (or an error out of them) as the
/// update phase.
struct UpdateAfter;

impl Drop for UpdateAfter {
    fn drop(&mut self) {
        memory::enter(Phase::Update);
    }
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
    /// Under fp8: the values whose scaled magnitude exceeded their format's
    /// maximum in the step (each saturated to that maximum).
    pub fp8_saturated: Option<u64>,
}

/// [`train_step_mixed`]'s settings by name: the precision, then an optional
/// loss scaler and gradient clip, and [`run`](MixedStep::run) with the model,
/// the micro-batches, the loss and the optimizer.
///
/// Two micro-batches of 1 and 3 rows, weighted 1/4 and 3/4, make one bf16
/// step of a 4-row batch:
///
/// ```
/// use tinyllm::nn::{Layer, Linear, Module};
/// use tinyllm::optim::{Optimizer, Sgd};
/// use tinyllm::precision::Precision;
/// use tinyllm::{Device, Generator, MixedStep, Tensor};
///
/// let dev = Device::Cpu;
/// let model = Linear::new(2, 1, false, &Generator::new(0), dev)?;
/// let mut opt = Sgd::new(model.parameters(), 0.1, 0.0, 0.0)?;
/// let rows = |v: Vec<f32>, n| Tensor::from_vec(v, &[n, 2], dev);
/// let micro = [
///     (rows(vec![1.0, 0.0], 1)?, Tensor::zeros(&[1, 1], tinyllm::DType::F32, dev)?),
///     (rows(vec![0.0, 1.0, 1.0, 1.0, 2.0, 0.0], 3)?, Tensor::zeros(&[3, 1], tinyllm::DType::F32, dev)?),
/// ];
/// let mse = |(x, y): &(Tensor, Tensor)| tinyllm::ops::nn::mse(&model.forward(x)?, y);
/// let report = MixedStep::new(Precision::Bf16)
///     .clip(1.0)
///     .run(&model, &micro, mse, &mut opt)?;
/// assert!(!report.skipped && report.grad_norm.is_some());
/// assert!(report.loss.is_finite());
/// # Ok::<(), tinyllm::Error>(())
/// ```
pub struct MixedStep<'s> {
    /// The autocast format of the forward and backward passes (`Fp32`: none).
    pub precision: Precision,
    /// The dynamic loss scaler (fp16 needs one); `None`: the loss unscaled and
    /// a non-finite loss or gradient an error.
    pub scaler: Option<&'s mut DynamicLossScaler>,
    /// Clip the global gradient norm to this before the update.
    pub clip: Option<f32>,
    /// The cast policy of the forward and backward passes when `precision`
    /// is 16-bit (`None`: `matmuls` at its format, plain autocast).
    pub cast_policy: Option<CastTable>,
    /// Runs the Linear layers' products in fp8 with this recipe's delayed
    /// scales, updated after the optimizer step.
    pub fp8: Option<Rc<RefCell<DelayedScaling>>>,
}

impl<'s> MixedStep<'s> {
    /// A step in `precision`, without a scaler or clipping.
    pub fn new(precision: Precision) -> MixedStep<'s> {
        MixedStep {
            precision,
            scaler: None,
            clip: None,
            cast_policy: None,
            fp8: None,
        }
    }

    /// Runs the Linear layers' products in fp8 under `recipe` (see
    /// [`tensor::fp8`](crate::tensor::fp8)).
    pub fn fp8(mut self, recipe: &Rc<RefCell<DelayedScaling>>) -> Self {
        self.fp8 = Some(recipe.clone());
        self
    }

    /// Runs the passes under `policy` instead of `matmuls` (when
    /// `precision` is 16-bit; a float32 step stays float32).
    pub fn cast_policy(mut self, policy: &CastPolicy) -> Self {
        self.cast_policy = Some(policy.table());
        self
    }

    /// Scales the loss with `scaler`, which also unscales, checks and may
    /// skip the update.
    pub fn scaler(mut self, scaler: &'s mut DynamicLossScaler) -> Self {
        self.scaler = Some(scaler);
        self
    }

    /// Clips the global gradient norm to `max_norm` before the update.
    pub fn clip(mut self, max_norm: f32) -> Self {
        self.clip = Some(max_norm);
        self
    }

    /// The step: [`train_step_mixed`] with these settings.
    pub fn run<M: crate::nn::Module + ?Sized, B: MicroBatch>(
        self,
        model: &M,
        micro_batches: &[B],
        loss_fn: impl FnMut(&B) -> Result<Tensor>,
        opt: &mut dyn Optimizer,
    ) -> Result<StepReport> {
        let table = match self.precision.format() {
            Some(f) => Some(self.cast_policy.unwrap_or(CastTable::matmuls(f))),
            None => None,
        };
        let report = {
            let _fp8 = self.fp8.as_ref().map(fp8_scope);
            step_under(
                model,
                micro_batches,
                loss_fn,
                opt,
                table,
                self.scaler,
                self.clip,
            )
        };
        let Some(recipe) = self.fp8 else {
            return report;
        };
        // Delayed scaling: the amaxes recorded in this step set the next
        // step's scales; a step that failed leaves the scales as they were.
        let mut recipe = recipe.borrow_mut();
        let mut report = match report {
            Ok(r) => r,
            Err(e) => {
                recipe.discard_pending();
                return Err(e);
            }
        };
        report.fp8_saturated = Some(recipe.update()?.saturated);
        Ok(report)
    }
}

/// One training step in mixed precision: zero the gradients, accumulate the
/// micro-batches under `autocast(precision)` (none for fp32: an autocast the
/// caller opened stays in force), then one step: check and unscale, clip to
/// `clip`, the optimizer's step. The scaler decides what an overflow does: it
/// skips the update and lowers the scale; without a scaler the scale is fixed
/// at 1, and non-finite gradients or a non-finite loss are an error before
/// any update, the gradients zeroed.
///
/// The reference design's positional call; [`MixedStep`] names the
/// settings. Returns what the step did ([`StepReport`]). Errors: the micro-batches
/// hold no rows ([`Error::Shape`](crate::Error::Shape)); without a scaler, a
/// non-finite loss or gradient ([`Error::Numerical`](crate::Error::Numerical));
/// or whatever `loss_fn`, the backward pass or the optimizer returns.
pub fn train_step_mixed<M: crate::nn::Module + ?Sized, B: MicroBatch>(
    model: &M,
    micro_batches: &[B],
    loss_fn: impl FnMut(&B) -> Result<Tensor>,
    opt: &mut dyn Optimizer,
    precision: Precision,
    scaler: Option<&mut DynamicLossScaler>,
    clip: Option<f32>,
) -> Result<StepReport> {
    let table = precision.format().map(CastTable::matmuls);
    step_under(model, micro_batches, loss_fn, opt, table, scaler, clip)
}

/// [`train_step_mixed`] with the passes under the cast policy `table`
/// (`None`: whatever autocast the caller opened).
fn step_under<M: crate::nn::Module + ?Sized, B: MicroBatch>(
    model: &M,
    micro_batches: &[B],
    loss_fn: impl FnMut(&B) -> Result<Tensor>,
    opt: &mut dyn Optimizer,
    table: Option<CastTable>,
    scaler: Option<&mut DynamicLossScaler>,
    clip: Option<f32>,
) -> Result<StepReport> {
    let params = model.parameters();
    for p in &params {
        p.zero_grad();
    }
    // Without a scaler the scale is fixed at 1: the loss goes into backward
    // as it is, and an overflow is an error instead of a skipped step.
    let mut scaling = match scaler {
        Some(s) => LossScaling::Dynamic(s),
        None => LossScaling::Fixed,
    };
    let losses = {
        let _ac = table.map(autocast);
        backward_all(micro_batches, loss_fn, scaling.scaler())?
    };
    // The losses come back with the gradients' finite check: one readback.
    // A finite loss can still have non-finite gradients (an op whose
    // derivative blows up): the check finds them before clipping or the
    // optimizer spreads them into every weight.
    let loss_values: Vec<Storage> = losses.values.iter().map(Tensor::storage).collect();
    let loss_refs: Vec<&Storage> = loss_values.iter().collect();
    let total = |values: &[f64]| losses.total(values);
    let _traced = crate::trace::phase("optimizer");
    let done = scaling.step(opt, &params, clip, Some((&loss_refs, &total)))?;
    Ok(StepReport {
        loss: done.loss.expect("the losses are read back with the check"),
        skipped: !done.stepped,
        scale: scaling.scale(),
        grad_norm: done.grad_norm,
        fp8_saturated: None,
    })
}
