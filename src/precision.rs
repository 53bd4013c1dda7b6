//! Mixed precision: emulated bf16/fp16 rounding,
//! `cast`, the `autocast` scope and `DynamicLossScaler`. The training step
//! built on them (`grad_accumulate`, `train_step_mixed`) lives with the
//! trainer, in [`train::step`](crate::train::step).
//!
//! Mixed precision rounds what a matmul reads and writes — and, under a cast
//! policy other than the default `matmuls` ([`CastPolicy`]), the outputs of
//! the op classes the policy names — and nothing else: the
//! parameters, their gradients' accumulation and the optimizer state stay
//! float32 ("master weights"), so an update smaller than bf16's spacing still
//! lands.

use crate::backend::round::Format;
use crate::backend::{Storage, UnaryOp};
use crate::optim::{clip_and_step, grad_storages, Optimizer};
use crate::{bail, Error, Result, Tensor};
use serde::{Deserialize, Serialize};

// ------------------------------------------------------------- rounding ----

/// Every entry rounded to the nearest bf16 value (ties to even), dtype kept
/// (f64 rounds from f64 directly). Not differentiable: a constant.
pub fn round_to_bf16(x: &Tensor) -> Result<Tensor> {
    round_to(x, Format::Bf16)
}

/// Every entry rounded to the nearest fp16 value: overflow to ±inf past the
/// rounding boundary above 65504, subnormals down to 2^-24, dtype kept.
pub fn round_to_fp16(x: &Tensor) -> Result<Tensor> {
    round_to(x, Format::Fp16)
}

/// Every entry rounded to the nearest `fmt` value (ties to even), dtype
/// kept: [`round_to_bf16`] or [`round_to_fp16`] by format. Not
/// differentiable: a constant. For the differentiable conversion use [`cast`].
pub fn round_to(x: &Tensor, fmt: Format) -> Result<Tensor> {
    Ok(
        Tensor::from_storage(x.storage().unary(UnaryOp::Round(fmt))?, x.shape())?
            .with_half(Some(fmt)),
    )
}

/// The emulated storage conversion as an op: forward `y = rd(x)`, backward
/// `x̄ = rd(ȳ)` — the gradient passes through the conversion (its true
/// derivative is zero almost everywhere) and arrives as a 16-bit value.
pub fn cast(x: &Tensor, fmt: Format) -> Result<Tensor> {
    let s = x.storage().unary(UnaryOp::Round(fmt))?;
    let y = Tensor::record(s, x.shape().to_vec(), "cast", &[x], move |g| {
        Ok(vec![Some(round_to(g, fmt)?)])
    });
    Ok(y.with_half(Some(fmt)))
}

// ------------------------------------------------------------- autocast ----

pub use crate::tensor::autocast::{
    autocast, autocast_dtype, autocast_scope, cast_table, AutocastGuard, CastPolicy, CastTable,
    OpClass, Rule, Scope,
};
pub use crate::tensor::fp8::{
    fp8_scope, AmaxReduction, DelayedScaling, Fp8Config, Fp8Guard, Fp8Report, Fp8State, Role,
    ScaledTensor,
};

/// `autocast(Format::Bf16)`.
#[must_use = "autocast ends when the guard is dropped: bind it to a named variable, or use autocast_scope"]
pub fn autocast_bf16() -> AutocastGuard {
    autocast(Format::Bf16)
}

/// `autocast` with a format given by name ("bf16", "fp16"); an unknown name is
/// an error and changes nothing.
pub fn autocast_named(name: &str) -> Result<AutocastGuard> {
    Ok(autocast(name.parse::<Format>()?))
}

/// The precision of a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Precision {
    /// Plain float32: no autocast, no loss scaling.
    Fp32,
    /// Matmuls under bf16 autocast; bf16 has float32's range, so no loss
    /// scaling is needed.
    Bf16,
    /// Matmuls under fp16 autocast, with a [`DynamicLossScaler`] against
    /// gradient underflow and overflow.
    Fp16,
}

impl Precision {
    /// The format matmuls round to under this precision (`None` for `Fp32`).
    pub fn format(self) -> Option<Format> {
        match self {
            Precision::Fp32 => None,
            Precision::Bf16 => Some(Format::Bf16),
            Precision::Fp16 => Some(Format::Fp16),
        }
    }
    /// The short name, `"fp32"`, `"bf16"` or `"fp16"` (which `FromStr` accepts,
    /// as it does `"float32"`, `"bfloat16"` and `"float16"`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fp32" | "float32" => Ok(Precision::Fp32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "fp16" | "float16" => Ok(Precision::Fp16),
            _ => bail!(
                Config,
                "unknown precision {s:?}: expected fp32, bf16 or fp16"
            ),
        }
    }
}

// ---------------------------------------------------- DynamicLossScaler ----

/// Dynamic loss scaling for fp16 (bf16 has float32's range and needs none).
///
/// The loss is multiplied by `S` before backward, which multiplies every
/// gradient by `S` (backprop is linear) and lifts small ones out of fp16's
/// underflow. `step` then checks every gradient: any non-finite value skips the
/// step, drops the gradients and multiplies `S` by `backoff`; otherwise the
/// gradients are unscaled, clipped (in true units), the optimizer steps, and
/// after `interval` consecutive good steps `S` grows by `growth`. The count of
/// good steps restarts after every overflow and every growth.
///
/// ```
/// use tinyllm::optim::Sgd;
/// use tinyllm::precision::DynamicLossScaler;
/// use tinyllm::{Device, Tensor};
/// let w = Tensor::from_vec(vec![1.0, 2.0], &[2], Device::Cpu)?.requires_grad_(true);
/// let mut opt = Sgd::new(vec![w.clone()], 0.1, 0.0, 0.0)?;
/// let mut scaler = DynamicLossScaler::new(1024.0, 2.0, 0.5, 2000)?;
///
/// // A good step: the scaled loss gives gradients times S, unscaled before the update.
/// scaler.scale_loss(&w.sum_all()?)?.backward()?;
/// assert_eq!(w.grad().unwrap().to_vec_f32()?, vec![1024.0, 1024.0]);
/// assert!(scaler.step(&mut opt, &[w.clone()], None)?);
/// assert_eq!(w.grad().unwrap().to_vec_f32()?, vec![1.0, 1.0]);
/// assert_eq!(scaler.good_steps(), 1);
///
/// // A step whose scaled gradients overflow to inf: skipped, S halved.
/// w.zero_grad();
/// let before = w.to_vec_f32()?;
/// scaler.scale_loss(&w.mul_scalar(1e38)?.sum_all()?)?.backward()?;
/// assert!(!scaler.step(&mut opt, &[w.clone()], None)?);
/// assert_eq!(scaler.loss_scale(), 512.0);
/// assert_eq!(scaler.good_steps(), 0);
/// assert!(w.grad().is_none()); // the poisoned gradients are dropped
/// assert_eq!(w.to_vec_f32()?, before); // and the weights untouched
/// # Ok::<(), tinyllm::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct DynamicLossScaler {
    scale: f32,
    growth: f32,
    backoff: f32,
    interval: u64,
    good_steps: u64,
    last_grad_norm: Option<f32>,
}

/// What [`DynamicLossScaler::state_dict`] saves: enough to resume with the
/// same scale and count.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The current loss scale `S` (a power of two).
    pub scale: f32,
    /// The factor `S` grows by after `interval` good steps (a power of two above 1).
    pub growth: f32,
    /// The factor `S` is multiplied by after an overflow (a power of two in (0, 1)).
    pub backoff: f32,
    /// The number of consecutive good steps before `S` grows (at least 1).
    pub interval: u64,
    /// Consecutive good steps since the last overflow or growth (below `interval`).
    pub good_steps: u64,
}

/// Below this the scale cannot rescue anything: every step overflows even with
/// gradients shrunk by 2^24, so the run reports an error instead of looping.
pub const MIN_SCALE: f32 = 5.960_464_5e-8; // 2^-24

impl Default for DynamicLossScaler {
    fn default() -> Self {
        DynamicLossScaler::new(65536.0, 2.0, 0.5, 2000).expect("valid defaults")
    }
}

/// Whether `x` is a normal float32 power of two (a zero mantissa).
fn is_power_of_two(x: f32) -> bool {
    x.is_normal() && x > 0.0 && x.to_bits() & 0x007f_ffff == 0
}

/// The scale, growth and backoff must be powers of two: then `loss · S` and
/// the unscale `g · (1/S)` only change exponents, so they are exact, and every
/// scale the scaler reaches is a power of two too.
fn validate(scale: f32, growth: f32, backoff: f32, interval: u64) -> Result<()> {
    if !(scale.is_finite() && scale > 0.0) {
        bail!(
            Config,
            "loss scale must be a positive finite number, got {scale}"
        );
    }
    if !is_power_of_two(scale) {
        bail!(Config,
            "loss scale must be a power of two (got {scale}; e.g. {}): only then are scaling and unscaling exact",
            2f32.powi(scale.log2().round().clamp(-126.0, 127.0) as i32)
        );
    }
    if !(growth.is_finite() && growth > 1.0 && is_power_of_two(growth)) {
        bail!(
            Config,
            "growth factor must be a power of two above 1 (e.g. 2), got {growth}"
        );
    }
    if !(backoff > 0.0 && backoff < 1.0 && is_power_of_two(backoff)) {
        bail!(
            Config,
            "backoff factor must be a power of two in (0, 1) (e.g. 0.5), got {backoff}"
        );
    }
    if interval == 0 {
        bail!(Config, "growth interval must be at least 1");
    }
    Ok(())
}

impl DynamicLossScaler {
    /// A scaler starting at scale `init`, multiplying it by `growth` after
    /// `interval` consecutive good steps and by `backoff` after an overflow. The
    /// [`Default`] is `new(65536.0, 2.0, 0.5, 2000)` (PyTorch's `GradScaler`).
    ///
    /// Errors ([`Error::Config`]) unless `init` is a positive finite power of two,
    /// `growth` a power of two above 1, `backoff` a power of two in (0, 1), and
    /// `interval` at least 1: only powers of two make scaling and unscaling exact.
    pub fn new(init: f32, growth: f32, backoff: f32, interval: u64) -> Result<Self> {
        validate(init, growth, backoff, interval)?;
        Ok(DynamicLossScaler {
            scale: init,
            growth,
            backoff,
            interval,
            good_steps: 0,
            last_grad_norm: None,
        })
    }
    /// The current loss scale `S`.
    pub fn loss_scale(&self) -> f32 {
        self.scale
    }
    /// Consecutive good steps since the last overflow or growth.
    pub fn good_steps(&self) -> u64 {
        self.good_steps
    }
    /// The gradient norm (before clipping, in true units) the last `step`
    /// measured: `None` if it skipped or was not asked to clip.
    pub fn last_grad_norm(&self) -> Option<f32> {
        self.last_grad_norm
    }
    /// `loss · S`, differentiable: call `backward` on this rather than on `loss`.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        loss.mul_scalar(self.scale as f64)
    }

    /// Checks, unscales, clips, steps and updates `S`; returns whether the
    /// optimizer stepped. `params` are the parameters whose gradients are
    /// checked (those `opt` updates); `clip` is a maximum global gradient norm
    /// in true units (see [`clip_grad_norm_`](crate::optim::clip_grad_norm_)). On an overflow the gradients of
    /// `params` are cleared and `S` backs off; errors
    /// ([`Error::Numerical`]) once `S` falls below [`MIN_SCALE`]. The check and
    /// the unscale are one fused primitive (on the GPU: one kernel per gradient
    /// buffer, one 4-byte readback).
    pub fn step(
        &mut self,
        opt: &mut dyn Optimizer,
        params: &[Tensor],
        clip: Option<f32>,
    ) -> Result<bool> {
        Ok(LossScaling::Dynamic(self)
            .step(opt, params, clip, None)?
            .stepped)
    }

    /// An overflow: back off, or fail once no scale can help.
    fn back_off(&mut self) -> Result<()> {
        self.scale *= self.backoff;
        self.good_steps = 0;
        if self.scale < MIN_SCALE {
            bail!(Numerical, "loss scale fell to {:e} after repeated overflows: the gradients are non-finite at any scale (a NaN in the model or the data?)", self.scale);
        }
        Ok(())
    }

    /// A good step: count it, and grow `S` after `interval` of them.
    fn count_good_step(&mut self, grad_norm: Option<f32>) {
        self.last_grad_norm = grad_norm;
        self.good_steps += 1;
        if self.good_steps >= self.interval {
            // Never grow to inf: an infinite scale would poison every step and
            // back off to inf again (skipping forever instead of failing).
            let grown = self.scale * self.growth;
            if grown.is_finite() {
                self.scale = grown;
            }
            self.good_steps = 0;
        }
    }

    /// The scale, factors and good-step count, for a checkpoint.
    pub fn state_dict(&self) -> ScalerState {
        ScalerState {
            scale: self.scale,
            growth: self.growth,
            backoff: self.backoff,
            interval: self.interval,
            good_steps: self.good_steps,
        }
    }

    /// Restores a saved state; invalid values are an error and change nothing.
    pub fn load_state_dict(&mut self, sd: &ScalerState) -> Result<()> {
        validate(sd.scale, sd.growth, sd.backoff, sd.interval)
            .map_err(|e| e.context("loss scaler state"))?;
        if sd.good_steps >= sd.interval {
            bail!(
                Config,
                "loss scaler state: good_steps {} must be below the interval {}",
                sd.good_steps,
                sd.interval
            );
        }
        *self = DynamicLossScaler {
            scale: sd.scale,
            growth: sd.growth,
            backoff: sd.backoff,
            interval: sd.interval,
            good_steps: sd.good_steps,
            last_grad_norm: None,
        };
        Ok(())
    }
}

// ------------------------------------------------------------- the step ----

/// The loss scale of a training step, and what an overflow does: the one
/// thing that differs between training with and without a loss scaler. The
/// step itself, [`LossScaling::step`], is written once for both.
pub(crate) enum LossScaling<'s> {
    /// No scaler: a fixed scale of 1 (the loss is not multiplied), which never
    /// grows or backs off. An overflow — non-finite gradients, or a
    /// non-finite loss — is an error ([`Error::Numerical`]): the gradients are
    /// dropped and no update is made.
    Fixed,
    /// The dynamic scaler: non-finite gradients skip the update, drop the
    /// gradients and back `S` off; good steps let it grow. The loss is only
    /// reported (the trainer ends a run whose losses stay non-finite).
    Dynamic(&'s mut DynamicLossScaler),
}

/// Values read back with the finite check (one GPU sync for both: the
/// training step's losses), and the loss they make.
pub(crate) type Readback<'a> = (&'a [&'a Storage], &'a dyn Fn(&[f64]) -> Result<f32>);

/// What [`LossScaling::step`] did.
pub(crate) struct Stepped {
    /// False when the update was skipped (the dynamic scaler's overflow).
    pub stepped: bool,
    /// The global gradient norm before clipping, when it clipped.
    pub grad_norm: Option<f32>,
    /// The loss made from the values read back, when some were.
    pub loss: Option<f32>,
}

impl LossScaling<'_> {
    /// The scale `S` the loss is multiplied by: 1 when fixed.
    pub(crate) fn scale(&self) -> f32 {
        match self {
            LossScaling::Fixed => 1.0,
            LossScaling::Dynamic(s) => s.scale,
        }
    }

    /// The scaler, when the scale is dynamic (it scales the losses before
    /// backward; a fixed scale leaves them as they are).
    pub(crate) fn scaler(&self) -> Option<&DynamicLossScaler> {
        match self {
            LossScaling::Fixed => None,
            LossScaling::Dynamic(s) => Some(s),
        }
    }

    /// The step after backward: check every gradient of `params` for
    /// non-finite values while unscaling it by `1/S` (one fused primitive: on
    /// the GPU one kernel per buffer and one readback, which brings
    /// `readback`'s values along), then on an overflow the policy's answer
    /// (error, or skip and back off), else clip to `clip` (in true units),
    /// step `opt` and count the good step. A scale of 1 makes the unscale an
    /// exact no-op.
    pub(crate) fn step(
        &mut self,
        opt: &mut dyn Optimizer,
        params: &[Tensor],
        clip: Option<f32>,
        readback: Option<Readback<'_>>,
    ) -> Result<Stepped> {
        if let LossScaling::Dynamic(s) = self {
            s.last_grad_norm = None;
        }
        crate::optim::lay_out_grads(params)?;
        let grads = grad_storages(params);
        let refs: Vec<&Storage> = grads.iter().collect();
        let inv = crate::backend::math::div(1.0, self.scale());
        let check =
            Storage::finite_check_unscale_reading(&refs, inv, readback.map_or(&[], |r| r.0))?;
        let loss = match readback {
            Some((_, loss_of)) => Some(loss_of(&check.also)?),
            None => None,
        };
        let sum_squares = check.sum_squares.filter(|_| !self.loss_overflows(loss));
        let Some(sum_squares) = sum_squares else {
            // Drop the poisoned gradients so nothing adds onto them.
            for p in params {
                p.zero_grad();
            }
            match self {
                LossScaling::Fixed => {
                    let what = match loss {
                        Some(l) if !l.is_finite() => "loss",
                        _ => "gradients",
                    };
                    let loss = loss.map_or(String::new(), |l| format!(" (loss {l})"));
                    bail!(
                        Numerical,
                        "non-finite {what}{loss} without a loss scaler: no update was made"
                    );
                }
                LossScaling::Dynamic(s) => s.back_off()?,
            }
            return Ok(Stepped {
                stepped: false,
                grad_norm: None,
                loss,
            });
        };
        let grad_norm = clip_and_step(opt, params, sum_squares, clip)?;
        if let LossScaling::Dynamic(s) = self {
            s.count_good_step(grad_norm);
        }
        Ok(Stepped {
            stepped: true,
            grad_norm,
            loss,
        })
    }

    /// Whether a non-finite `loss` is an overflow even with finite gradients:
    /// for the fixed scale, which has no scale to lower and stops at the first
    /// sign of trouble; not for the dynamic scaler, whose gradients decide
    /// (the trainer ends a run whose losses stay non-finite).
    fn loss_overflows(&self, loss: Option<f32>) -> bool {
        matches!(self, LossScaling::Fixed) && loss.is_some_and(|l| !l.is_finite())
    }
}
