//! Neural-network functions: softmax, log-softmax, the causal mask, dropout,
//! and the mean squared error (cross-entropy is a fused op, `ops::fused`).

use super::{arrived, stored};
use crate::backend::{Device, Storage};
use crate::rng::Generator;
use crate::tensor::autocast::{output_format, OpClass};
use crate::tensor::saved::Saved;
use crate::tensor::shape::numel;
use crate::{bail, Result, Tensor};

impl Tensor {
    /// Softmax over the last axis: `x: (.., n) -> (.., n)`, one fused primitive
    /// each way (backward `y (g − Σ g y)`).
    pub fn softmax(&self) -> Result<Tensor> {
        self.softmax_with(1.0, false, OpClass::Softmax)
    }

    /// Attention's softmax over scores `x: (.., t, t)`: `softmax(x · scale +
    /// causal mask)` as one primitive each way — bit for bit the composition
    /// `x.mul_scalar(scale)?.causal_mask()?.softmax()` for finite scores
    /// (masked keys are −inf whatever they hold), without its two extra
    /// passes over the scores forward and two backward. `scale > 0`.
    pub fn causal_softmax(&self, scale: f64) -> Result<Tensor> {
        self.causal_softmax_as(scale, OpClass::Softmax)
    }

    /// Attention's probabilities: [`causal_softmax`](Self::causal_softmax)
    /// stored as the autocast policy's `attention_probs` entry says (the
    /// fused attention's softmax, in the composition it stands for).
    pub fn attention_probs(&self, scale: f64) -> Result<Tensor> {
        self.causal_softmax_as(scale, OpClass::AttentionProbs)
    }

    fn causal_softmax_as(&self, scale: f64, class: OpClass) -> Result<Tensor> {
        let r = self.dims();
        if r < 2 || self.shape()[r - 1] != self.shape()[r - 2] {
            bail!(
                Shape,
                "causal_softmax needs square trailing axes, got {:?}",
                self.shape()
            );
        }
        let s = scale as f32;
        if !(s > 0.0 && s.is_finite()) {
            bail!(
                Numerical,
                "causal_softmax: the scale must be positive and finite (got {scale})"
            );
        }
        self.softmax_with(s, true, class)
    }

    /// The output stored as the policy says for `class`; backward reads it
    /// as stored.
    fn softmax_with(&self, scale: f32, causal: bool, class: OpClass) -> Result<Tensor> {
        let f = output_format(class, &[self]);
        let n = *self
            .shape()
            .last()
            .ok_or_else(|| crate::Error::shape("softmax of a 0-d tensor"))?;
        let rows = numel(self.shape()) / n.max(1);
        let s = stored(self.storage().softmax_rows(rows, n, scale, causal)?, f)?;
        // kept as stored: in 16 bits when the policy stores it so
        let y = Saved::output(&Tensor::from_storage(s.clone(), self.shape())?.with_half(f))?;
        Ok(Tensor::record(
            s,
            self.shape().to_vec(),
            if causal { "causal_softmax" } else { "softmax" },
            &[self],
            move |g| {
                let y = y.get()?;
                let gs =
                    y.storage()
                        .softmax_rows_backward(&arrived(g, f)?.storage(), rows, n, scale)?;
                Ok(vec![Some(Tensor::from_storage(gs, y.shape())?)])
            },
        )
        .with_half(f))
    }

    /// `x − logsumexp(x)` over the last axis, stably: the row max is
    /// subtracted first (as a constant: it cancels in the gradient).
    pub fn log_softmax(&self) -> Result<Tensor> {
        let m = {
            let _g = crate::no_grad();
            self.detach().max(-1, true)?
        };
        let z = self.sub(&m)?;
        let lse = z.exp()?.sum(-1, true)?.log()?;
        z.sub(&lse)
    }

    /// Adds the causal mask to attention scores `(.., t, t)`: position `j > i`
    /// gets `-inf`, so its softmax weight is exactly 0.
    pub fn causal_mask(&self) -> Result<Tensor> {
        let r = self.dims();
        if r < 2 || self.shape()[r - 1] != self.shape()[r - 2] {
            bail!(
                Shape,
                "causal_mask needs square trailing axes, got {:?}",
                self.shape()
            );
        }
        let t = self.shape()[r - 1];
        let mask: Vec<f32> = (0..t * t)
            .map(|ij| {
                if ij % t > ij / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, &[t, t], self.device())?.to_dtype(self.dtype())?;
        self.add(&mask)
    }
}

/// Mean squared error `mean((pred − target)²)` over all elements, as a 0-d
/// tensor. Errors if the shapes differ.
pub fn mse(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    if pred.shape() != target.shape() {
        bail!(
            Shape,
            "mse: prediction {:?} and target {:?} differ in shape",
            pred.shape(),
            target.shape()
        );
    }
    pred.sub(target)?.square()?.mean_all()
}

/// Dropout: zeroes each element with probability `p` and scales the rest by
/// `1 / (1 − p)`. The mask comes from `gen`'s Philox stream (the same bits on
/// either device), so recording and restoring `gen` replays it exactly.
pub fn dropout(x: &Tensor, p: f32, gen: &Generator, training: bool) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        bail!(Config, "dropout probability must be in [0, 1), got {p}");
    }
    if !training || p == 0.0 {
        return Ok(x.clone());
    }
    let st = gen.reserve(x.numel());
    let scale = crate::backend::math::div(1.0, 1.0 - p);
    let mask = Storage::dropout_mask(x.numel(), p, scale, st.seed, st.offset, x.device())?;
    let mask = Tensor::from_storage(mask, x.shape())?;
    let mask = if x.device() == Device::Cpu {
        mask.to_dtype(x.dtype())?
    } else {
        mask
    };
    x.mul(&mask)
}
