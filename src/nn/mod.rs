//! Layers. A [`Module`] lists its trainable tensors in a stable order; a
//! [`Layer`] maps one tensor to one tensor, which is what
//! [`Sequential`] and `checkpoint_sequential` chain.

pub mod llama;

use crate::backend::Device;
use crate::ops::dropout;
use crate::rng::Generator;
use crate::tensor::fp8;
use crate::{bail, Result, Tensor};
use std::cell::Cell;
use std::rc::Rc;

pub use crate::module::{Layer, Module};

/// `y = x Wᵀ (+ b)`, weight `(out, in)` — the PyTorch / Hugging Face layout.
pub struct Linear {
    /// The weight, `(out, in)`; trainable.
    pub weight: Tensor,
    /// The bias, `(out,)`, if the layer has one; trainable.
    pub bias: Option<Tensor>,
}

impl Linear {
    /// A layer from `inp` to `out` features, with a bias if `bias`. PyTorch's
    /// default init: uniform in `±1/√in` for weight and bias, drawn from `gen`
    /// (weight first). Errors only if `device` cannot be reached.
    pub fn new(
        inp: usize,
        out: usize,
        bias: bool,
        gen: &Generator,
        device: Device,
    ) -> Result<Linear> {
        let bound = 1.0 / (inp as f32).sqrt();
        let weight = Tensor::uniform(&[out, inp], bound, gen, device)?.requires_grad_(true);
        let bias = if bias {
            Some(Tensor::uniform(&[out], bound, gen, device)?.requires_grad_(true))
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }
    /// Normal(0, std²) weights, no bias (the Llama's projections).
    pub fn normal(
        inp: usize,
        out: usize,
        std: f32,
        gen: &Generator,
        device: Device,
    ) -> Result<Linear> {
        Ok(Linear {
            weight: Tensor::randn(&[out, inp], std, gen, device)?.requires_grad_(true),
            bias: None,
        })
    }
}

impl Module for Linear {
    fn parameters(&self) -> Vec<Tensor> {
        std::iter::once(self.weight.clone())
            .chain(self.bias.clone())
            .collect()
    }
}

impl Linear {
    /// `residual + self.forward(x)`, the sum formed as the product writes
    /// its outputs where it can ([`Tensor::matmul_t_add`]: no bias).
    pub fn forward_add(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        if self.bias.is_some() || x.dims() < 2 || fp8::active().is_some() {
            return residual.residual_add(&self.forward(x)?);
        }
        self.check_input(x)?;
        x.matmul_t_add(&self.weight, residual)
    }

    /// [`forward`](Layer::forward) of `swiglu(gate, up)`, plus `residual`
    /// if given: one primitive where it can ([`Tensor::swiglu_matmul_t`]: no
    /// bias, no fp8 scope). The gate and up are released as soon as SwiGLU
    /// has read them.
    pub fn forward_gated(
        &self,
        gate: Tensor,
        up: Tensor,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        if self.bias.is_some() || up.dims() < 2 || fp8::active().is_some() {
            let h = gate.swiglu(&up)?;
            drop((gate, up));
            return match residual {
                Some(r) => self.forward_add(&h, r),
                None => self.forward(&h),
            };
        }
        self.check_input(&up)?;
        gate.swiglu_matmul_t(up, &self.weight, residual)
    }

    /// Each layer's [`forward`](Layer::forward) of one input, their products
    /// computed as one primitive ([`Tensor::matmul_t_shared`]) where that is
    /// all they are: no bias, weights of one shape, no fp8 scope. The weights
    /// are laid side by side first if they are not ([`Tensor::colocate`],
    /// once: the optimizer updates them in place), so that on a GPU the
    /// products are one dispatch.
    pub fn forward_shared<const N: usize>(x: &Tensor, ls: [&Linear; N]) -> Result<[Tensor; N]> {
        let w0 = ls.first().map(|l| l.weight.shape());
        let plain = x.dims() >= 2
            && fp8::active().is_none()
            && ls
                .iter()
                .all(|l| l.bias.is_none() && Some(l.weight.shape()) == w0);
        let ys = if plain {
            for l in ls {
                l.check_input(x)?;
            }
            let ws = ls.map(|l| &l.weight);
            if !Tensor::side_by_side(&ws) {
                Tensor::colocate(&ws)?;
            }
            x.matmul_t_shared(&ws)?
        } else {
            ls.iter()
                .map(|l| l.forward(x))
                .collect::<Result<Vec<_>>>()?
        };
        Ok(ys
            .try_into()
            .unwrap_or_else(|_| unreachable!("one output per layer")))
    }

    fn check_input(&self, x: &Tensor) -> Result<()> {
        let inp = self.weight.shape()[1];
        if x.shape().last() != Some(&inp) {
            bail!(
                Shape,
                "Linear({inp} -> {}): input of shape {:?}",
                self.weight.shape()[0],
                x.shape()
            );
        }
        Ok(())
    }
}

impl Layer for Linear {
    /// `x: (.., in) -> (.., out)`
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.check_input(x)?;
        let inp = self.weight.shape()[1];
        if x.dims() == 1 {
            return self
                .forward(&x.reshape(&[1, inp])?)?
                .reshape(&[self.weight.shape()[0]]);
        }
        // batched over the leading axes, the weight shared: the same sums as
        // one (rows, in) product, and x itself is the product's input, so
        // its gradient adds into what x gathered before (no reshape between)
        let y = match fp8::active() {
            Some(recipe) => crate::ops::fp8::linear(x, &self.weight, &recipe)?,
            None => x.matmul_t(&self.weight)?,
        };
        match &self.bias {
            // over (rows, out): the bias gradient one fold over the rows
            Some(b) => {
                let (shape, out) = (y.shape().to_vec(), self.weight.shape()[0]);
                y.reshape(&[y.numel() / out.max(1), out])?
                    .add(b)?
                    .reshape(&shape)
            }
            None => Ok(y),
        }
    }
}

/// A table of `(num, dim)` vectors looked up by id.
pub struct Embedding {
    /// The table, `(num, dim)`: row `i` is id `i`'s vector; trainable.
    pub weight: Tensor,
}

impl Embedding {
    /// A table of `num` vectors of width `dim`, entries Normal(0, std²) drawn
    /// from `gen`. Errors only if `device` cannot be reached.
    pub fn new(
        num: usize,
        dim: usize,
        std: f32,
        gen: &Generator,
        device: Device,
    ) -> Result<Embedding> {
        Ok(Embedding {
            weight: Tensor::randn(&[num, dim], std, gen, device)?.requires_grad_(true),
        })
    }
    /// The rows for `ids`: `ids: (n,) -> (n, dim)`. Backward scatter-adds into
    /// the table's gradient. Errors if an id is `>= num`.
    pub fn forward(&self, ids: &[u32]) -> Result<Tensor> {
        // stored as the autocast policy's `embedding` entry says (the
        // table is float32: `follow` keeps the rows float32)
        let f = crate::tensor::autocast::output_format(
            crate::tensor::autocast::OpClass::Embedding,
            &[&self.weight],
        );
        crate::ops::stored_as(self.weight.embedding(ids)?, f)
    }
}

impl Module for Embedding {
    fn parameters(&self) -> Vec<Tensor> {
        vec![self.weight.clone()]
    }
}

/// `y = x / √(mean(x²) + eps) · w` over the last axis.
pub struct RmsNorm {
    /// The per-feature gain `w`, `(dim,)`, initialised to ones; trainable.
    pub weight: Tensor,
    /// Added to the mean square before the square root (e.g. `1e-5`).
    pub eps: f64,
}

impl RmsNorm {
    /// A norm over a last axis of width `dim`, with gain ones. Errors only if
    /// `device` cannot be reached.
    pub fn new(dim: usize, eps: f64, device: Device) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: Tensor::ones(&[dim], crate::DType::F32, device)?.requires_grad_(true),
            eps,
        })
    }
}

impl Module for RmsNorm {
    fn parameters(&self) -> Vec<Tensor> {
        vec![self.weight.clone()]
    }
}

impl Layer for RmsNorm {
    /// `x: (.., d) -> (.., d)`
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = if x.dtype() == self.weight.dtype() {
            self.weight.clone()
        } else {
            self.weight.to_dtype(x.dtype())?
        };
        // one fused primitive each way, the composition's bits
        // (ops::fused::reference::rms_norm)
        x.rms_norm(&w, self.eps)
    }
}

/// Zeroes entries with probability `p` while training; draws its masks from a
/// shared [`Generator`] so recompute can replay them.
pub struct Dropout {
    /// The probability of zeroing an entry, in `[0, 1)`.
    pub p: f32,
    /// The generator the masks are drawn from (a handle shared with the caller's).
    pub gen: Generator,
    training: Cell<bool>,
}

impl Dropout {
    /// A dropout layer in training mode, drawing from (a shared handle to)
    /// `gen`. Errors ([`Error::Config`](crate::Error::Config)) unless `0 <= p < 1`.
    pub fn new(p: f32, gen: &Generator) -> Result<Dropout> {
        if !(0.0..1.0).contains(&p) {
            bail!(Config, "dropout probability must be in [0, 1), got {p}");
        }
        Ok(Dropout {
            p,
            gen: gen.clone(),
            training: Cell::new(true),
        })
    }
}

impl Module for Dropout {
    fn parameters(&self) -> Vec<Tensor> {
        vec![]
    }
    fn set_training(&self, on: bool) {
        self.training.set(on)
    }
}

impl Layer for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        dropout(x, self.p, &self.gen, self.training.get())
    }
}

/// `x σ(x)`.
pub struct Silu;

impl Module for Silu {
    fn parameters(&self) -> Vec<Tensor> {
        vec![]
    }
}

impl Layer for Silu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.silu()
    }
}

/// Layers applied in order.
#[derive(Default)]
pub struct Sequential {
    /// The layers, first applied first.
    pub layers: Vec<Rc<dyn Layer>>,
}

impl Sequential {
    /// The layers `layers`, applied first to last.
    pub fn new(layers: Vec<Rc<dyn Layer>>) -> Sequential {
        Sequential { layers }
    }
    /// Appends `l`, to run after the layers already there.
    pub fn push(&mut self, l: impl Layer + 'static) {
        self.layers.push(Rc::new(l));
    }
}

impl Module for Sequential {
    fn parameters(&self) -> Vec<Tensor> {
        self.layers.iter().flat_map(|l| l.parameters()).collect()
    }
    fn set_training(&self, on: bool) {
        self.layers.iter().for_each(|l| l.set_training(on))
    }
}

impl Layer for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward(&h)?;
        }
        Ok(h)
    }
}
