//! In-place updates of the float32 master weights and their gradients: AdamW,
//! SGD, scaling (clipping) and the loss scaler's fused finite check + unscale.
//!
//! ## Contract (per element; every multiply-add an explicit fma)
//! * AdamW, PyTorch's formula:
//!   ```text
//!   p1 = p * decay
//!   m  = fma(beta1, m, omb1 * g)
//!   v  = fma(beta2, v, omb2 * (g * g))
//!   den = div(sqrt(v), bc2_sqrt) + eps
//!   p  = fma(-step_size, div(m, den), p1)
//!   ```
//!   With a `grad_scale` c (clipping, fused into the update): first
//!   `g = g * c`, stored back into the gradient, then the update from that
//!   `g` — the bits of `scale_in_place(c)` followed by the plain update.
//! * SGD with momentum and (coupled) weight decay: `g' = fma(wd, p, g)`; with
//!   momentum `buf = fma(momentum, buf, g')` (the first step sets `buf = g'`),
//!   `g' = buf`; `p = fma(-lr, g', p)`.
//! * `scale_in_place`: `x = x * c`, exactly rounded.
//! * `finite_check_unscale`: every gradient multiplied in place by
//!   `inv_scale` (a power of two: exact), one flag saying whether every
//!   value of every buffer was finite *before* the multiply, and the sum of
//!   squares of the values *after* it, chunk by chunk exactly as
//!   [`Storage::sum_squares`] sums them (what clipping measures: one pass
//!   and, on the GPU, one readback for the check and the norm; one kernel
//!   per buffer, every invocation walking one chunk in order).

mod cpu;
pub(crate) mod spec;
#[cfg(feature = "gpu")]
pub(crate) mod gpu;

use super::reduce::fold_partials;
use super::{observed_value, on_device, primitive};
use super::{Device, Storage};
use crate::{bail, Result};

/// Hyper-parameters of one AdamW update, narrowed to f32 on the host so both
/// backends use the same constants (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConsts {
    /// `1 - lr * weight_decay`
    pub decay: f32,
    pub beta1: f32,
    /// `1 - beta1`
    pub omb1: f32,
    pub beta2: f32,
    /// `1 - beta2`
    pub omb2: f32,
    /// `lr / (1 - beta1^t)`
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`
    pub bc2_sqrt: f32,
    pub eps: f32,
    /// Multiplies the gradient in place first (see the module docs).
    pub grad_scale: Option<f32>,
}

/// The two devices' in-place updates (see the module docs for the contract).
/// One parameter's AdamW update: the parameter, its gradient, its moments
/// and the constants.
pub struct AdamWItem<'a, S> {
    pub p: &'a S,
    pub g: &'a S,
    pub m: &'a S,
    pub v: &'a S,
    pub c: AdamWConsts,
}

pub trait UpdateOps: Sized {
    /// Unscales every buffer in place: true when all values were finite
    /// before, and every buffer's chunk partials of the sum of squares after,
    /// in buffer order. `also`'s values, one buffer after another, come back
    /// with the verdict (on a GPU in the same readback: the step's losses
    /// ride along with its finite flag).
    fn finite_check_unscale(
        bufs: &[&Self],
        inv_scale: f32,
        also: &[&Self],
    ) -> Result<(bool, Vec<f32>, Vec<f64>)>;
    fn scale_in_place(&self, c: f32) -> Result<()>;
    /// `self` is the parameter.
    fn adamw_step(&self, g: &Self, m: &Self, v: &Self, c: &AdamWConsts) -> Result<()>;
    /// [`adamw_step`](Self::adamw_step) of each item, in order; a GPU
    /// updates several a dispatch.
    fn adamw_many(items: &[AdamWItem<'_, Self>]) -> Result<()> {
        items.iter().try_for_each(|it| it.p.adamw_step(it.g, it.m, it.v, &it.c))
    }
    /// `self` is the parameter; `buf` the momentum buffer, if any.
    #[allow(clippy::too_many_arguments)]
    fn sgd_step(
        &self,
        g: &Self,
        buf: Option<&Self>,
        lr: f32,
        momentum: f32,
        wd: f32,
        first: bool,
    ) -> Result<()>;
}

fn check_len(what: &str, p: &Storage, others: &[&Storage]) -> Result<()> {
    if others.iter().any(|o| o.len() != p.len()) {
        bail!(
            Shape,
            "{what}: the parameter and its gradient and state must have the same length"
        );
    }
    Ok(())
}

/// What the loss scaler's fused pass over the gradients found.
#[derive(Clone, Debug, PartialEq)]
pub struct GradCheck {
    /// Whether every value of every buffer was finite before the multiply.
    pub finite: bool,
    /// When they were, the contract's sum of squares of the unscaled values
    /// (the global gradient norm's square, as clipping measures it).
    pub sum_squares: Option<f32>,
    /// The values of the buffers read back with the verdict, in order.
    pub also: Vec<f64>,
}

impl Storage {
    /// The loss scaler's fused check and unscale over every gradient buffer
    /// (the tests' and benchmarks' entry point).
    #[cfg(any(feature = "cli", feature = "test-hooks"))]
    pub fn finite_check_unscale(grads: &[&Storage], inv_scale: f32) -> Result<bool> {
        Ok(Storage::finite_check_unscale_reading(grads, inv_scale, &[])?.finite)
    }

    /// The loss scaler's fused check and unscale over every gradient buffer,
    /// with the sum of squares of the unscaled gradients, reading `also`'s
    /// values back with the verdict: one GPU sync for all three.
    pub fn finite_check_unscale_reading(
        grads: &[&Storage],
        inv_scale: f32,
        also: &[&Storage],
    ) -> Result<GradCheck> {
        let mut prof = crate::profile::scope("finite check + unscale");
        let n = grads.len();
        let parts: Vec<&Storage> = grads.iter().chain(also).copied().collect();
        if parts.is_empty() {
            return Ok(GradCheck {
                finite: true,
                sum_squares: Some(0.0),
                also: Vec::new(),
            });
        }
        let (finite, partials, values): (bool, Vec<f32>, Vec<f64>) = on_device!(slice &parts => |xs| {
            let (gs, rest) = xs.split_at(n);
            UpdateOps::finite_check_unscale(gs, inv_scale, rest)
        });
        // Reads every gradient and `also`, writes the gradients back unscaled.
        prof.moved(|| {
            let (read, written) = (super::traffic("", &parts, &[]), super::traffic("", grads, &[]));
            let elements = grads.iter().map(|g| g.len()).sum::<usize>() as f64;
            crate::profile::Traffic {
                bytes: read.bytes + written.bytes,
                elements,
            }
        });
        let lens = || format!("buffers {:?}", grads.iter().map(|g| g.len()).collect::<Vec<_>>());
        let on_gpu = parts[0].device() == Device::Gpu;
        let args = || format!("{} times {inv_scale:e}", lens());
        let flag = observed_value("finite check + unscale", args, grads, on_gpu, finite as u8 as f32)?;
        let finite = flag == 1.0;
        // A non-finite sum is never used (the step stops), and its NaN's bits
        // are the device's: it is neither returned nor traced.
        let sum_squares = match finite {
            true => Some(observed_value("sum of squares", lens, &[], on_gpu, fold_partials(partials))?),
            false => None,
        };
        Ok(GradCheck {
            finite,
            sum_squares,
            also: values,
        })
    }

    /// In place: `self *= c` (clipping).
    pub fn scale_in_place(&self, c: f32) -> Result<()> {
        let describe = || format!("n {} times {c:e}", self.len());
        primitive!(writes [self], "scale in place", describe, [self] => |x| x.scale_in_place(c));
        Ok(())
    }

    /// In-place AdamW on the parameter `self`, its gradient and moments.
    pub fn adamw_step(&self, grad: &Storage, m: &Storage, v: &Storage, c: &AdamWConsts) -> Result<()> {
        let item = AdamWItem { p: self, g: grad, m, v, c: *c };
        Storage::adamw_many(&[item], |_| None::<()>)
    }

    /// [`adamw_step`](Storage::adamw_step) of each item (all on one device)
    /// as one primitive: on a GPU, a few parameters a dispatch where the
    /// parameters and each moment are laid out alike ([`Storage::colocate`]).
    /// Each item's output is observed (traced) on its own, at `site(i)`.
    pub fn adamw_many<'a, G>(items: &[AdamWItem<'a, Storage>], site: impl Fn(usize) -> Option<G>) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        for it in items {
            check_len("AdamW", it.p, &[it.g, it.m, it.v])?;
        }
        let name = "adamw";
        let mut prof = crate::profile::scope(name);
        let parts: Vec<&Storage> = items.iter().flat_map(|it| [it.p, it.g, it.m, it.v]).collect();
        on_device!(slice &parts => |ds| {
            let each: Vec<AdamWItem<'_, _>> = ds
                .chunks(4)
                .zip(items)
                .map(|(d, it)| AdamWItem { p: d[0], g: d[1], m: d[2], v: d[3], c: it.c })
                .collect();
            UpdateOps::adamw_many(&each)
        });
        // with a grad_scale the gradient is scaled in place too
        let writes = |it: &AdamWItem<'a, Storage>| -> Vec<&'a Storage> {
            match it.c.grad_scale {
                Some(_) => vec![it.p, it.m, it.v, it.g],
                None => vec![it.p, it.m, it.v],
            }
        };
        let written: Vec<&Storage> = items.iter().flat_map(writes).collect();
        prof.moved(|| super::traffic(name, &parts, &written));
        for (i, it) in items.iter().enumerate() {
            let _at = site(i);
            super::observed(name, || format!("n {} {:?}", it.p.len(), it.c), &writes(it))?;
        }
        Ok(())
    }

    /// In-place SGD on the parameter `self`.
    pub fn sgd_step(
        &self,
        grad: &Storage,
        buf: Option<&Storage>,
        lr: f32,
        momentum: f32,
        wd: f32,
        first: bool,
    ) -> Result<()> {
        match buf {
            None => {
                check_len("SGD", self, &[grad])?;
                let describe = || format!("n {} lr {lr:e} wd {wd:e}", self.len());
                primitive!(writes [self], "sgd", describe, [self, grad] => |p, g| {
                    p.sgd_step(g, None, lr, momentum, wd, first)
                })
            }
            Some(b) => {
                check_len("SGD", self, &[grad, b])?;
                let describe = || {
                    let n = self.len();
                    format!("n {n} lr {lr:e} momentum {momentum:e} wd {wd:e} first {first}")
                };
                primitive!(writes [self, b], "sgd", describe, [self, grad, b] => |p, g, b| {
                    p.sgd_step(g, Some(b), lr, momentum, wd, first)
                })
            }
        }
        Ok(())
    }
}
