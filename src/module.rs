//! What a model is made of, below both [`nn`](crate::nn) (which builds
//! layers) and [`recompute`](crate::recompute) (which checkpoints them): a
//! [`Module`] lists its trainable tensors in a stable order; a [`Layer`] maps
//! one tensor to one tensor, which is what `Sequential` and
//! `checkpoint_sequential` chain.

use crate::{Result, Tensor};
use std::rc::Rc;

/// A model or a part of one: something with trainable tensors (and, for
/// dropout, a training switch). Optimizers and checkpoints work on
/// [`parameters`](Module::parameters).
pub trait Module {
    /// Trainable tensors, in a stable order (checkpoints rely on it).
    fn parameters(&self) -> Vec<Tensor>;
    /// Switches training behaviour (dropout) on or off.
    fn set_training(&self, _on: bool) {}
}

/// One tensor in, one tensor out.
pub trait Layer: Module {
    /// Applies the layer to `x`, recording the graph when grad mode is on;
    /// errors if `x` does not have the shape the layer takes.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
}

impl<L: Layer + ?Sized> Module for Box<L> {
    fn parameters(&self) -> Vec<Tensor> {
        (**self).parameters()
    }
    fn set_training(&self, on: bool) {
        (**self).set_training(on)
    }
}

impl<L: Layer + ?Sized> Layer for Box<L> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (**self).forward(x)
    }
}

impl<L: Layer + ?Sized> Module for Rc<L> {
    fn parameters(&self) -> Vec<Tensor> {
        (**self).parameters()
    }
    fn set_training(&self, on: bool) {
        (**self).set_training(on)
    }
}

impl<L: Layer + ?Sized> Layer for Rc<L> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (**self).forward(x)
    }
}
