//! The executable spec: a third device whose primitives are each family's
//! `## Contract` written out as plainly as Rust allows — scalar, one thread,
//! no SIMD, no `unsafe`, one element at a time in the contract's order. It
//! is the oracle the fast CPU kernels and the WGSL twins are held to (the
//! parity suite and the sweep compare both against it), and a device like
//! the others ([`Device::Spec`](super::Device::Spec)), so a whole training
//! step can run on it.
//!
//! Each family's `spec.rs` implements that family's trait for
//! [`SpecStorage`]; the dispatch ([`on_device!`](super::on_device)) has an
//! arm for this device, so a primitive without a spec does not compile.
//! What the spec shares with the other devices is the ground the contract is
//! written in: the math library ([`math`](super::math): division, square
//! root, `exp`, `log`), the integer rounding ([`round`](super::round)) and
//! the Philox generator ([`rng`](crate::rng)).
//!
//! Speed is no aim: small shapes only (tests, the sweep, a short lockstep).

#![forbid(unsafe_code)]

use super::cpu::Buf;
use std::cell::{Ref, RefMut};

/// A buffer of float32 values on the spec device (counted like the CPU's).
#[derive(Debug)]
pub struct SpecStorage(Buf<f32>);

impl SpecStorage {
    pub fn new(values: Vec<f32>) -> SpecStorage {
        SpecStorage(Buf::new(values))
    }
    pub fn len(&self) -> usize {
        self.0.get().len()
    }
    #[cfg(feature = "test-hooks")]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The values (read).
    pub fn get(&self) -> Ref<'_, Vec<f32>> {
        self.0.get()
    }
    /// The values (written in place: the optimizer's updates).
    pub fn get_mut(&self) -> RefMut<'_, Vec<f32>> {
        self.0.get_mut()
    }
    /// The value at `i`.
    pub fn at(&self, i: usize) -> f32 {
        self.0.get()[i]
    }
}

/// `fma(a, b, c)`: `a·b + c` rounded once.
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    a.mul_add(b, c)
}

/// The contract's `maximum`: NaN if either is NaN (the first one), else the
/// larger, `+0` over `−0`.
pub fn maximum(a: f32, b: f32) -> f32 {
    if a.is_nan() {
        a
    } else if b.is_nan() {
        b
    } else if a == 0.0 && b == 0.0 {
        // ±0 against ±0: −0 only when both are
        if a.is_sign_negative() && b.is_sign_negative() {
            a
        } else {
            0.0
        }
    } else if b > a {
        b
    } else {
        a
    }
}

/// The row-major multi-index of flat position `i` over `shape`.
pub fn multi_index(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (a, &n) in shape.iter().enumerate().rev() {
        idx[a] = i % n.max(1);
        i /= n.max(1);
    }
    idx
}

/// `Σ idx·strides`.
pub fn dot(idx: &[usize], strides: &[usize]) -> usize {
    idx.iter().zip(strides).map(|(i, s)| i * s).sum()
}
